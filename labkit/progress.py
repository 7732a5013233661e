"""Progress bars: a widget in JupyterLab, plain text in a terminal, none in a batch-run notebook."""

from __future__ import annotations

import sys

from labkit.runmode import in_kernel, is_batch


def progress(iterable=None, desc: str = "", total: int | None = None):
    """Wrap an iterable in a progress bar suited to where the code runs (no iterable: a bar of `total` to update())."""
    if in_kernel():  # a batch run's notebook (make run, papermill) keeps no bar in its outputs
        from tqdm.auto import tqdm
        return iterable if is_batch() and iterable is not None else tqdm(iterable, desc=desc, total=total,
                                                                          disable=is_batch())
    from tqdm.std import tqdm
    return tqdm(iterable, desc=desc, total=total, mininterval=2.0, file=sys.stderr, ascii=True)
