"""Progress bars: a widget in JupyterLab, plain text in a terminal, none in a batch-run notebook."""

from __future__ import annotations

import sys

from labkit.runmode import in_kernel, is_batch


def progress(iterable, desc: str = ""):
    """Wrap an iterable in a progress bar suited to where the code runs."""
    if in_kernel():  # a batch run's notebook (make run, papermill) keeps no bar in its outputs
        from tqdm.auto import tqdm
        return iterable if is_batch() else tqdm(iterable, desc=desc)
    from tqdm.std import tqdm
    return tqdm(iterable, desc=desc, mininterval=2.0, file=sys.stderr, ascii=True)
