"""Execute a notebook with papermill in batch mode and read back what it recorded (`labkit.record`)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from labkit.results import MIME_TYPE

ERROR_CHARS = 2000
SAVE_EVERY_S = 10.0  # the executed notebook is written at most this often while it runs (and always at its end)


def records_from_notebook(nb) -> dict[str, object]:
    """Collect the recorded measurements from an executed notebook (nbformat node or dict)."""
    out: dict[str, object] = {}
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if MIME_TYPE in data:
                payload = data[MIME_TYPE]
                if isinstance(payload, str):
                    payload = json.loads(payload)
                name = payload["name"]
                if payload.get("rank") not in (None, 0):
                    name = f"{name}@rank{payload['rank']}"
                out[name] = payload["value"]
    return out


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Set environment variables (inherited by kernels) for the duration, then restore the environment."""
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def socket_prefix() -> str:
    """Return a fresh path prefix for a kernel's Unix sockets: short (a socket's path holds at most 107 bytes)."""
    return os.path.join(tempfile.gettempdir(), f"kernel-{uuid.uuid4().hex[:16]}")


def over_ipc(manager: type) -> type:
    """Return a subclass of jupyter_client's `manager` whose kernels listen on Unix sockets of their own, not TCP ports.

    jupyter_client finds five TCP ports free, closes them and hands them to the kernel, which binds them a moment later:
    a process in between (another test's kernel, any outgoing connection) can take one, and the kernel dies with
    "Address already in use" (a CI run, eight kernels starting at once). A socket file named by a fresh random prefix
    cannot be taken, and ipykernel does not warn about it as it does about plain TCP.
    """
    from traitlets import default

    class IPCKernelManager(manager):
        @default("transport")
        def _ipc(self):
            return "ipc"

        @default("ip")
        def _socket_prefix(self):
            return socket_prefix()

    return IPCKernelManager


def kernel_manager_class():
    """Return papermill's kernel manager class: over IPC on POSIX (`over_ipc`), CurveZMQ-encrypted TCP elsewhere."""
    import zmq
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    if os.name == "posix":
        return over_ipc(AsyncKernelManager)
    if "transport_encryption" in AsyncKernelManager.class_trait_names() and zmq.has("curve"):
        class CurveKernelManager(AsyncKernelManager):
            @default("transport_encryption")
            def _curve_when_the_kernel_supports_it(self):
                return "auto"
        return CurveKernelManager
    return AsyncKernelManager


@functools.cache
def _engine_name() -> str:
    """Register, once, papermill's nbclient engine with its notebook written every SAVE_EVERY_S seconds and at the end,
    not before and after every cell (papermill's default: 122 whole-notebook writes, 1.9 s, of chapter 00's run on
    a 2-core Xeon); return its name."""
    from papermill.engines import NBClientEngine, NotebookExecutionManager, papermill_engines

    class SavedNowAndThen(NotebookExecutionManager):
        def save(self, **kwargs):
            if (self.now() - self.last_save_time).total_seconds() >= SAVE_EVERY_S:
                super().save(**kwargs)

        def notebook_complete(self, **kwargs):  # called whatever happened (papermill's Engine: in a `finally`)
            super().notebook_complete(**kwargs)
            NotebookExecutionManager.save(self)

    class Engine(NBClientEngine):
        @classmethod
        def execute_notebook(cls, nb, kernel_name, output_path=None, progress_bar=True, log_output=False,
                             autosave_cell_every=30, **kwargs):  # papermill's Engine.execute_notebook, our manager
            nb_man = SavedNowAndThen(nb, output_path=output_path, progress_bar=progress_bar, log_output=log_output,
                                     autosave_cell_every=autosave_cell_every)
            nb_man.notebook_start()
            try:
                cls.execute_managed_notebook(nb_man, kernel_name, log_output=log_output, **kwargs)
            finally:
                nb_man.cleanup_pbar()
                nb_man.notebook_complete()
            return nb_man.nb

    papermill_engines.register("labkit-nbclient", Engine)
    return "labkit-nbclient"


def error_text(exc: BaseException) -> str:
    """Return `name: value` of a (papermill) error, shortened to ERROR_CHARS."""
    ename = getattr(exc, "ename", None) or type(exc).__name__
    evalue = getattr(exc, "evalue", None)
    evalue = str(exc) if evalue is None else str(evalue)
    return f"{ename}: {evalue}"[:ERROR_CHARS]


def run_notebook(path: str | Path, executed: str | Path, parameters: dict, timeout_s: float,
                 extensions: Iterable[str] = (), env: dict[str, str] | None = None) -> dict:
    """Execute `path` into `executed` (LABKIT_BATCH=1, cwd its folder); return status, wall_s, measurements, error.

    `extensions`: IPython extensions the kernel loads; `env`: environment variables the kernel inherits.
    """
    import nbformat
    import papermill

    path = Path(path).resolve()
    executed = Path(executed)
    executed.parent.mkdir(parents=True, exist_ok=True)
    entry: dict = {"status": "ok"}
    start = time.perf_counter()
    with environment(LABKIT_BATCH="1", **(env or {})):
        try:
            papermill.execute_notebook(
                str(path), str(executed), parameters=dict(parameters), kernel_name="python3", engine_name=_engine_name(),
                cwd=str(path.parent), progress_bar=False, log_output=False,
                execution_timeout=timeout_s, kernel_manager_class=kernel_manager_class(),
                extra_arguments=[f"--IPKernelApp.extra_extensions={name}" for name in extensions],
            )
        except Exception as exc:  # PapermillExecutionError, timeouts, dead kernels: keep going
            entry["status"] = "failed"
            entry["error"] = error_text(exc)
    entry["wall_s"] = round(time.perf_counter() - start, 3)
    entry["measurements"] = {}
    if executed.exists():
        try:
            entry["measurements"] = records_from_notebook(nbformat.read(executed, as_version=4))
        except Exception as exc:  # an unreadable partial notebook must not hide the run's error
            entry.setdefault("error", f"could not read executed notebook: {error_text(exc)}")
    return entry
