"""Record a notebook's key measurements so that batch runs can collect them."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

from labkit.runmode import in_kernel

MIME_TYPE = "application/vnd.labkit.record+json"  # a record's output in a kernel: hidden, collected by execute
BUILD_DIR_ENV = "LABKIT_BUILD_DIR"  # where the workbook writes what it builds (studies, logs); overrides the rest
RESULTS_ENV = "LABKIT_RESULTS"  # the results.json a chapter reads others' figures from (a run's own, the tests' fixture)

_RECORDS: dict[str, object] = {}


def jsonable(value):
    """Convert tensors, numpy scalars, tuples and dict keys into plain JSON values."""
    if hasattr(value, "tolist") and callable(value.tolist):  # torch.Tensor, numpy array/scalar
        value = value.tolist()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no inf/nan
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"record() takes JSON-able values (numbers, strings, lists, dicts), got {type(value).__name__}")


def record(name: str, value) -> None:
    """Record one named measurement of this notebook (returns None: a cell ending in a record shows nothing)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"record name must be an identifier like 'peak_bytes', got {name!r}")
    value = jsonable(value)
    _RECORDS[name] = value
    payload = {"name": name, "value": value}
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        payload["rank"] = dist.get_rank()
    if in_kernel():
        from IPython.display import display
        display({MIME_TYPE: payload}, raw=True)  # no text/plain: nothing for a reader to see here


def recorded() -> dict[str, object]:
    """Return a copy of the measurements recorded in this process so far."""
    return dict(_RECORDS)


def show_records() -> None:
    """Show this run's records as one table, folded: one line per name, in recording order."""
    import html

    records = recorded()
    width = max((len(n) for n in records), default=0)
    lines = [f"{name:<{width}}  {_short(value)}" for name, value in records.items()]
    if not lines:
        print("no measurement recorded")
        return
    table = "".join(f"<tr><td style='text-align:left'><code>{html.escape(name)}</code></td>"
                    f"<td style='text-align:left'>{html.escape(_short(value))}</td></tr>"
                    for name, value in records.items())
    text = "\n".join([f"{len(lines)} measurements recorded (build/results.json keeps them):", *lines])
    if in_kernel():
        from IPython.display import display
        display({"text/plain": text,  # folded in JupyterLab: one line until the reader opens it
                 "text/html": f"<details><summary>{len(lines)} measurements recorded "
                              f"(<code>build/results.json</code> keeps them)</summary>"
                              f"<table style='font-size:90%'>{table}</table></details>"}, raw=True)
    else:
        print(text)


def clear() -> None:
    """Forget the measurements recorded in this process."""
    _RECORDS.clear()


def checkout_root() -> Path | None:
    """Return the project's checkout labkit runs from (editable install, `make setup`); None for an installed wheel."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "notebooks").is_dir() else None


def build_dir(*parts: str) -> Path:
    """Return a writable folder under build/, created: in $LABKIT_BUILD_DIR, the checkout, the cwd or the temp folder."""
    root = checkout_root()
    if os.environ.get(BUILD_DIR_ENV):
        places = [Path(os.environ[BUILD_DIR_ENV])]  # asked for: an error there is the user's to see
    else:
        user = getattr(os, "getuid", lambda: "user")()
        places = ([root / "build"] if root else []) + [Path.cwd() / "build",
                                                      Path(tempfile.gettempdir()) / f"labkit-build-{user}"]
    for i, base in enumerate(places):
        path = base.joinpath(*parts)
        try:
            path.mkdir(parents=True, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            if i == len(places) - 1:
                raise
    raise PermissionError(f"no writable build folder among {[str(p) for p in places]}; set {BUILD_DIR_ENV}")


VALUE_CHARS = 80  # a record's value in show_records' table, shortened past this


def _short(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= VALUE_CHARS else text[:VALUE_CHARS - 3] + "..."


def results_path(path: str | Path | None = None) -> Path:
    """Return the results.json to read other chapters' figures from: `path`, else $LABKIT_RESULTS (set by
    `workbook.runner` to its run's own), else build/results.json."""
    return Path(path or os.environ.get(RESULTS_ENV) or build_dir() / "results.json")
