"""Tell where the code runs: inside a Jupyter kernel or not, in a batch run (make run, tests) or not."""

from __future__ import annotations

import os


def in_kernel() -> bool:
    """Tell whether this code runs inside a Jupyter kernel (where displays reach a notebook)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def is_batch() -> bool:
    """Tell whether this run is a batch run (make run, tests): LABKIT_BATCH=1 in the environment."""
    return os.environ.get("LABKIT_BATCH", "") not in ("", "0")
