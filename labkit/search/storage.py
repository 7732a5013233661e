"""Where a search's studies live (chapter 08): the study file's URL and folder, a shared database's URL checked before
any work, and an Optuna RDBStorage with heartbeats whose SQLite transactions lock the file from their first read."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import optuna
import sqlalchemy
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

from labkit.results import build_dir
from labkit.validate import ParameterError


def sqlite_url(path: str | Path) -> str:
    """Return the SQLite URL of a study file (its folder is created)."""
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def default_build_dir() -> Path:
    """Return build/search/ of $LABKIT_BUILD_DIR, the checkout, the working directory or the temp folder."""
    return build_dir("search")


def make_storage(url: str, heartbeat_s: int = 2, grace_s: int = 6, max_retry: int = 2, connect_timeout_s: float = 10,
                 name: str = "url") -> RDBStorage:
    """Return an RDBStorage with heartbeats: a trial silent for `grace_s` is failed and retried (up to max_retry).

    Raises ParameterError naming `name` for a URL no worker could share or a database silent for `connect_timeout_s`.
    """
    parsed = _storage_url(name, url)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        try:
            return _LockingRDBStorage(url, heartbeat_interval=heartbeat_s, grace_period=grace_s,
                                      heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=max_retry),
                                      engine_kwargs=_engine_kwargs(parsed, connect_timeout_s))
        except sqlalchemy.exc.DBAPIError as e:
            raise ParameterError(_unreachable(name, parsed, connect_timeout_s, e)) from None


STORAGE_EXAMPLES = "sqlite:///path/to/file.db, or a database server: postgresql+psycopg://user@host:5432/db"


def check_study_names(prefix_name: str, prefix, resume_name: str, resume, storage_url: str) -> None:
    """Check a study name prefix (letters, digits, - and _) and the name of a study to resume ('' for none: a fresh
    study), which must be in `storage_url`; raise ParameterError naming the parameter otherwise (chapter 08)."""
    if not isinstance(prefix, str) or not prefix.replace("-", "").replace("_", "").isalnum():
        raise ParameterError(f"{prefix_name} must be a name of letters, digits, - and _, got {prefix!r}")
    if not isinstance(resume, str):
        raise ParameterError(f"{resume_name} must be '' or a study's name, got {resume!r}")
    if resume and resume not in optuna.get_all_study_names(storage_url):
        raise ParameterError(f"{resume_name} = {resume!r} is not a study in {storage_url}: give the name an earlier "
                             "run printed, or '' for a fresh study")


def check_storage_url(name: str, url, timeout_s: float = 10) -> str:
    """Return `url` if it names a database every worker can share that answers within `timeout_s`.

    Raises ParameterError naming `name` otherwise; a SQLite file is not created here.
    """
    parsed = _storage_url(name, url)
    if parsed.get_backend_name() == "sqlite":
        return url
    try:
        engine = sqlalchemy.create_engine(parsed, **_engine_kwargs(parsed, timeout_s))
    except ImportError as e:
        raise ParameterError(f"{name}: the driver of {parsed.drivername!r} is not installed ({e}); install it, or "
                             "name one that is (PostgreSQL: postgresql+psycopg://, pip install 'psycopg[binary]')") from None
    try:
        with engine.connect():
            pass
    except sqlalchemy.exc.DBAPIError as e:
        raise ParameterError(_unreachable(name, parsed, timeout_s, e)) from None
    finally:
        engine.dispose()
    return url


def _storage_url(name: str, url) -> sqlalchemy.engine.URL:
    """Return the parsed storage URL, or raise ParameterError naming `name` with what is allowed."""
    if not isinstance(url, str) or not url:
        raise ParameterError(f"{name} must be a database URL ({STORAGE_EXAMPLES}), got {url!r}")
    try:
        parsed = sqlalchemy.engine.make_url(url)
        parsed.get_dialect()  # an unknown dialect raises here, before any connection
    except (sqlalchemy.exc.ArgumentError, sqlalchemy.exc.NoSuchModuleError, ValueError) as e:
        raise ParameterError(f"{name} must be a database URL ({STORAGE_EXAMPLES}), got {url!r}: {e}") from None
    if parsed.get_backend_name() == "sqlite":
        db = parsed.database or ""
        if not db or ":memory:" in db or "mode=memory" in db or parsed.query.get("mode") == "memory":
            raise ParameterError(f"{name} must name a file that every worker process opens ({STORAGE_EXAMPLES}), "
                                 f"got {url!r}: an in-memory SQLite database exists only in the process that opened it")
        folder = Path(db.removeprefix("file:").split("?")[0]).parent
        if not folder.is_dir():
            raise ParameterError(f"{name}: the folder of the SQLite file {db!r} does not exist ({folder})")
    return parsed


def _engine_kwargs(parsed: sqlalchemy.engine.URL, connect_timeout_s: float) -> dict:
    """Return create_engine's arguments: a connect timeout for a server, a busy timeout for a SQLite file."""
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return {"connect_args": {"timeout": 60}}  # several worker processes on one file wait for its lock
    if backend in ("postgresql", "mysql", "mariadb"):
        return {"connect_args": {"connect_timeout": max(1, math.ceil(connect_timeout_s))}}  # libpq, MySQL drivers
    return {}


def _unreachable(name: str, parsed: sqlalchemy.engine.URL, timeout_s: float, error: Exception) -> str:
    """Return the message for a database that refused or did not answer."""
    shown = parsed.render_as_string(hide_password=True)
    cause = str(getattr(error, "orig", error)).strip().splitlines()[0]
    return f"{name}: could not connect to the database {shown} within {timeout_s:g} s: {cause}"


class _LockingRDBStorage(RDBStorage):
    """RDBStorage whose SQLite transactions lock the file from their first read (BEGIN IMMEDIATE; optuna #4621)."""

    def __init__(self, url: str, **kwargs):
        super().__init__(url, **kwargs)
        self._lock_on_first_read()

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._lock_on_first_read()

    def _lock_on_first_read(self) -> None:
        # self.engine: an RDBStorage attribute Optuna's docs do not offer users; SQLAlchemy's BEGIN
        # recipe needs the engine, and engine_kwargs cannot carry event listeners
        if self.engine.dialect.name != "sqlite":
            return
        # pysqlite would BEGIN at the first write, not the first read: it begins nothing itself, and each
        # SQLAlchemy transaction begins with SQLite's write lock
        sqlalchemy.event.listen(self.engine, "connect", lambda dbapi, record: setattr(dbapi, "isolation_level", None))
        sqlalchemy.event.listen(self.engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))
        self.engine.dispose()  # the connections opened so far were set up without the listeners
