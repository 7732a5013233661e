"""Counting a rank's work: `LocalWorkCounter` for ranks that hold DTensors (chapter 06's tensor parallelism).

`CommCounter` is the former name of `labkit.work.WorkCounter`, kept for rank scripts written against it; its table of
c10d operators is `labkit.work.COLLECTIVES`.
"""

from __future__ import annotations

from labkit.work import COLLECTIVES, NOT_COMMUNICATION, WorkCounter
from labkit.work import WorkCounter as CommCounter  # noqa: F401

__all__ = ["COLLECTIVES", "NOT_COMMUNICATION", "CommCounter", "LocalWorkCounter"]


class LocalWorkCounter(WorkCounter):
    """A WorkCounter that counts a DTensor's operators where they run: on this rank's local tensors (chapter 06).

    A dispatch mode sees an operator before a tensor subclass does, so `labkit.work.WorkCounter` counts a DTensor's
    matmul at the DTensor's global shape, as if this rank held every shard. This counter hands every operator on a
    DTensor back to it (NotImplemented): the DTensor runs it on its local tensors, each of which is counted, and so are
    the collectives it issues to do so.
    """

    def __init__(self, world_size: int | None = None):
        super().__init__(world_size)
        from torch.distributed.tensor import DTensor

        self._dtensor = DTensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, self._dtensor) for t in types):
            return NotImplemented
        return super().__torch_dispatch__(func, types, args, kwargs)
