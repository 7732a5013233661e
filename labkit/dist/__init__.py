"""Many processes: launch rank code on N local ranks from a notebook, and the runtime inside each rank.

    import labkit.dist as dist
    results = dist.launch("06_pipeline_ranks.py", nproc=2, params={...})   # in the notebook
    dist.run(main)                                                         # at the end of the rank script

`launch` (launch.py) is the notebook's side; `run`, `span`, `meter`, `device`, `rank`,
`world_size` (rank.py) are the rank's; `CommCounter` (comm.py) counts the bytes collectives move.
"""

from labkit.dist.comm import CommCounter
from labkit.dist.launch import RankFailure, RankResult, launch
from labkit.dist.rank import device, meter, now_s, rank, run, span, world_size

__all__ = ["CommCounter", "RankFailure", "RankResult", "device", "launch", "meter",
           "now_s", "rank", "run", "span", "world_size"]
