"""Progress bars: a widget in JupyterLab, plain text in a terminal or a batch run."""

from __future__ import annotations

import sys

from labkit.runmode import in_kernel, is_batch


def progress(iterable, desc: str = ""):
    """Wrap an iterable in a progress bar suited to where the code runs."""
    if in_kernel() and not is_batch():
        from tqdm.auto import tqdm
        return tqdm(iterable, desc=desc)
    from tqdm.std import tqdm
    return tqdm(iterable, desc=desc, mininterval=2.0, file=sys.stderr, ascii=True)
