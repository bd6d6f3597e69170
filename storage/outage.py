"""Driver failures as keygate errors, and a database outage told once in the log.

How it works. ``storage_error`` turns what a driver raised into what a caller (and through
it a client) sees: StorageUnavailable ("retry") when the database could not be reached or
the session was lost, StorageError when the database refused the statement. Drivers do
not always raise through SQLAlchemy: asyncpg refusing a session while connecting
(``ALTER DATABASE ... ALLOW_CONNECTIONS false``, a server starting up or shutting down)
raises its own PostgresError subclass, which SQLAlchemy's pool lets through as it is.
``driver_errors(dialect)`` is therefore what the store catches at its edge (StoreBase.transaction,
StoreBase.write), not SQLAlchemy's errors alone; a driver error that SQLAlchemy did not wrap
can only have been raised while connecting, so it means unavailable. Through SQLAlchemy,
the SQLSTATE tells a server that ends or refuses sessions (classes 08 and 57P0x, too many
connections) from one that refuses a statement: asyncpg's adapter raises both as a plain
DBAPIError.

A server that refuses a session for its settings — SQLSTATE class 28 (a wrong password,
an unknown user, a pg_hba.conf refusal) or 3D000 (no such database) — is unavailable too
(the call may be retried), but waiting does not heal it: ``is_misconfigured`` tells it.
asyncpg gives that SQLSTATE; psycopg (the writer thread, migrations) cannot, libpq giving
none for a refused connection, so ``diagnose`` asks asyncpg where the cause matters.

While the database cannot be reached every storage call fails the same way, hundreds a
second under load. ``OutageLog`` says so once: a WARNING with the first failure's reason,
then at most every OUTAGE_SUMMARY_INTERVAL seconds a WARNING counting the failures since,
and an INFO once a transaction commits again. A failure that is a misconfiguration is an
ERROR instead, told once per outage whenever it shows (first or later: the writer
thread's psycopg cannot tell one), naming its cause. It runs on the event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from typing import Final

import sqlalchemy as sa

from core.errors import StorageError, StorageUnavailable
from storage.engine import async_engine, is_sqlite

__all__ = [
    "OUTAGE_SUMMARY_INTERVAL",
    "OutageLog",
    "detail",
    "diagnose",
    "driver_errors",
    "is_misconfigured",
    "is_unavailable",
    "storage_error",
]

_log = logging.getLogger("keygate.storage")

# Seconds between the WARNINGs that count the storage calls an outage failed.
OUTAGE_SUMMARY_INTERVAL: Final = 10.0


@functools.cache
def driver_errors(dialect: str) -> tuple[type[BaseException], ...]:
    """What a store on ``dialect`` catches as "the driver failed" (the rest, keygate's
    errors and bugs, pass). PostgreSQL's drivers are imported only for a PostgreSQL store:
    importing asyncpg and psycopg costs a SQLite gateway 12 MB of memory."""
    errors: list[type[BaseException]] = [sa.exc.SQLAlchemyError, OSError]
    if dialect != "postgresql":
        return tuple(errors)
    # Each driver is optional (a store uses one of them): one not installed raises nothing.
    with contextlib.suppress(ImportError):
        import asyncpg  # type: ignore[import-untyped]

        errors += [asyncpg.PostgresError, asyncpg.InterfaceError]
    with contextlib.suppress(ImportError):
        import psycopg

        errors.append(psycopg.Error)
    return tuple(errors)


# SQLAlchemy's classes for failures to reach the database, not "this write is bad".
_UNAVAILABLE: Final = (
    OSError,
    sa.exc.OperationalError,
    sa.exc.InterfaceError,
    sa.exc.DisconnectionError,
    sa.exc.TimeoutError,
)
# SQLSTATEs of a server that ends or refuses sessions: admin shutdown, crash shutdown,
# cannot connect now, too many connections (class 08, connection exceptions, as well).
_UNAVAILABLE_SQLSTATES: Final = frozenset({"57P01", "57P02", "57P03", "53300"})
# SQLSTATEs of a session refused for its settings: invalid authorization (class 28), no
# such database.
_MISCONFIGURED_CLASS: Final = "28"
_NO_SUCH_DATABASE: Final = "3D000"
# Seconds ``diagnose`` waits for asyncpg's answer.
DIAGNOSE_TIMEOUT: Final = 10.0


def is_unavailable(error: BaseException) -> bool:
    """Whether driver error ``error`` means the database could not be reached."""
    if isinstance(error, _UNAVAILABLE) or getattr(error, "connection_invalidated", False):
        return True
    if not isinstance(error, sa.exc.SQLAlchemyError):
        return True  # the driver's own, let through by SQLAlchemy: raised while connecting
    sqlstate = getattr(getattr(error, "orig", None), "sqlstate", None)
    return isinstance(sqlstate, str) and (
        sqlstate.startswith("08") or sqlstate in _UNAVAILABLE_SQLSTATES
    )


def is_misconfigured(error: BaseException) -> bool:
    """Whether driver error ``error`` is a session refused for its settings (user,
    password, database), as far as the driver says (psycopg does not: ``diagnose``)."""
    sqlstate = getattr(getattr(error, "orig", None) or error, "sqlstate", None)
    return isinstance(sqlstate, str) and (
        sqlstate.startswith(_MISCONFIGURED_CLASS) or sqlstate == _NO_SUCH_DATABASE
    )


def detail(error: BaseException) -> str:
    """The driver's error in one line, for the log (never for a client)."""
    cause = getattr(error, "orig", None) or error
    return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"


async def diagnose(url: str) -> BaseException | None:
    """Whether the PostgreSQL server at ``url`` refuses a session for its settings: the
    error asyncpg gets (SQLSTATE class 28 or 3D000), else None. For a failure to connect
    through psycopg, which does not say why in a form a program can read."""
    if is_sqlite(url):
        return None
    engine = async_engine(url)
    try:
        async with asyncio.timeout(DIAGNOSE_TIMEOUT), engine.connect():
            return None
    except driver_errors("postgresql") as e:  # TimeoutError (asyncio.timeout) is an OSError
        return e if is_misconfigured(e) else None
    finally:
        await engine.dispose()


def storage_error(error: BaseException, outage: OutageLog | None = None) -> StorageError:
    """The error a caller (and through it a client) sees for a driver failure.

    Its text is short and fixed: the driver's message can hold the SQL statement and its
    parameters, that is other clients' data. The details go to the log, here (through
    ``outage`` when the database is unreachable, so that an outage is told once).
    """
    if is_unavailable(error):
        outage = outage or OutageLog(_log)
        outage.unavailable(detail(error), misconfigured=is_misconfigured(error))
        return StorageUnavailable("storage unavailable")
    _log.error("database refused a statement: %s", detail(error))
    return StorageError("storage error")


class OutageLog:
    """The log of one store's outages: one WARNING when it begins, a count every
    ``interval`` seconds while it lasts, one INFO when the database answers again."""

    def __init__(
        self,
        log: logging.Logger,
        *,
        interval: float = OUTAGE_SUMMARY_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._interval = interval
        self._clock = clock
        # clock() when the current outage began; None while the database answers.
        self.since: float | None = None
        self._told = 0.0
        self._failed = 0  # storage calls failed since the last line
        self._total = 0
        self._misconfigured = False  # told, this outage

    def unavailable(self, detail: str, *, misconfigured: bool = False) -> None:
        """A storage call failed because the database could not be reached, or
        (``misconfigured``) refused a session for the URL's user, password or database."""
        now = self._clock()
        self._total += 1
        first = self.since is None
        if self.since is None:
            self.since, self._told, self._failed, self._total = now, now, 0, 1
            self._misconfigured = False
        else:
            self._failed += 1
        since = self.since
        if misconfigured and not self._misconfigured:
            self._misconfigured = True
            self._log.error(
                "the database refuses the gateway's sessions: %s; check the user, password "
                "and database of the db setting (a configuration error: waiting does not "
                "heal it); storage calls fail with storage-unavailable until it is fixed",
                detail,
            )
        elif first:
            self._log.warning(
                "database unavailable: %s; storage calls fail with storage-unavailable "
                "until it answers again",
                detail,
            )
        elif now - self._told >= self._interval:
            self._log.warning(
                "database %s for %.0f s: %d more storage calls failed (last: %s)",
                "refusing the gateway's sessions" if self._misconfigured else "unavailable",
                now - since,
                self._failed,
                detail,
            )
            self._told, self._failed = now, 0

    def answered(self) -> None:
        """A transaction committed: the outage, if any, is over."""
        if self.since is None:
            return
        self._log.info(
            "database answers again after %.1f s unavailable (%d storage calls failed)",
            self._clock() - self.since,
            self._total,
        )
        self.since = None
