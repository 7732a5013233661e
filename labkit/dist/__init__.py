"""Many processes: `launch` rank code on N local ranks from a notebook; `run`, `span`, `meter` inside a rank."""

from labkit.dist.comm import CommCounter  # deprecated name of labkit.work.WorkCounter
from labkit.dist.launch import RankFailure, RankResult, launch
from labkit.dist.rank import device, meter, now_s, rank, run, span, time_actions, world_size

__all__ = ["CommCounter", "RankFailure", "RankResult", "device", "launch", "meter",
           "now_s", "rank", "run", "span", "time_actions", "world_size"]
