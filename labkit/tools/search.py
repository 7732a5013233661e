"""Work on notebook 08's studies from a terminal, on this machine or another: `python -m labkit.tools.search ...`.

    # one more worker on a study the notebook created (SQLite on one machine, an RDB URL across machines)
    python -m labkit.tools.search worker --storage sqlite:///build/search.db --study fit-the-model --trials 10

    # one trial, printing `val_loss=...` lines: the command a Katib trial (or any scheduler) runs
    python -m labkit.tools.search trial --config '{"budget_bytes": 38797312}' --technique none --precision bf16 \\
        --micro_batch 16 --lr 0.001

    # Katib's Experiment for the same search space, as YAML
    python -m labkit.tools.search katib --budget-bytes 38797312 --image registry.example/fit-the-model:latest
"""

from __future__ import annotations

import argparse
import json
import sys


def _worker(args) -> int:
    from labkit.children import die_with_parent

    die_with_parent()  # started by a notebook cell: never outlive it (ChildProcesses.start armed it first on Linux)
    import optuna
    import torch

    from labkit.search import storage as stores
    from labkit.search import study as studies
    from labkit.validate import ParameterError

    torch.set_num_threads(args.threads)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:  # an in-memory, malformed or silent database: said before any trial
        storage = stores.make_storage(args.storage, connect_timeout_s=args.connect_timeout, name="--storage")
    except ParameterError as e:
        print(f"python -m labkit.tools.search worker: {e}", file=sys.stderr)
        return 2
    for name in args.study:  # several studies: one after the other
        study = studies.load_study(name, storage, worker=args.index)
        studies.optimize(study, args.trials, total_trials=args.total)
    return 0


def _trial(args) -> int:
    from labkit.search.space import active
    from labkit.search.study import StudyConfig
    from labkit.search.trial import train

    config = StudyConfig(**json.loads(args.config))
    params = active({k: v for k, v in vars(args).items() if v is not None}, config.space())  # the space's names only
    result = train(params, config, report=lambda r: print(f"step={r.steps_run} val_loss={r.val_loss:.6f}", flush=True))
    peak = result.peak_bytes if result.peak_bytes is not None else result.predicted_peak_bytes
    print(f"status={result.status}")
    print(f"val_loss={result.val_loss:.6f}")
    print(f"peak_bytes={peak}")
    print(f"fits={int(result.fits)}")
    return 0


def _katib(args) -> int:
    from labkit.search.engines import katib_experiment, to_yaml
    from labkit.search.study import StudyConfig

    config = StudyConfig(budget_bytes=args.budget_bytes)
    print(to_yaml(katib_experiment(config, image=args.image, max_trials=args.trials, parallel=args.parallel)))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run a worker, one trial, or print Katib's Experiment."""
    parser = argparse.ArgumentParser(prog="python -m labkit.tools.search", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker", help="run trials of an existing study")
    w.add_argument("--storage", required=True, help="the study's storage URL (sqlite:///..., postgresql+psycopg://...)")
    w.add_argument("--study", required=True, nargs="+", help="the study's name (several: run them in turn)")
    w.add_argument("--trials", type=int, default=10, help="trials this worker runs at most")
    w.add_argument("--total", type=int, default=None, help="stop once the study holds this many finished trials")
    w.add_argument("--index", type=int, default=0, help="this worker's number (seeds its sampler)")
    w.add_argument("--threads", type=int, default=1, help="torch threads (one per core among the workers)")
    w.add_argument("--connect-timeout", type=float, default=10, help="seconds a database server has to accept a connection")
    t = sub.add_parser("trial", help="train one setting and print key=value lines")
    t.add_argument("--config", required=True, help="StudyConfig as JSON (at least budget_bytes)")
    t.add_argument("--technique", required=True)
    t.add_argument("--segments", type=int)
    t.add_argument("--precision")
    t.add_argument("--micro_batch", type=int)
    t.add_argument("--lr", type=float, required=True)
    k = sub.add_parser("katib", help="print Katib's Experiment YAML for the search space")
    k.add_argument("--budget-bytes", type=int, required=True, help="the budget every trial must fit")
    k.add_argument("--image", default="fit-the-model:latest", help="a container image with this repository installed")
    k.add_argument("--trials", type=int, default=24, help="maxTrialCount")
    k.add_argument("--parallel", type=int, default=2, help="parallelTrialCount")
    args = parser.parse_args(argv)
    return {"worker": _worker, "trial": _trial, "katib": _katib}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
