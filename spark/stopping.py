"""Releasing a stopped stream's group lease at once.

PySpark never calls a Python streaming source's ``stop()``. The stream reader runs in a
Python process that the driver's JVM starts for the query and ends when the query stops.
So the reader, once it holds a lease, leaves a claim file naming the driver JVM (its
parent process), itself, and the lease (url, queue, group, owner).
``spark.register(session)`` adds a StreamingQueryListener; when a query terminates it
releases the lease of every claim of its own JVM whose reader process has ended (waiting
up to ``_EXIT_WAIT`` seconds for it), and deletes the claim. A claim of a JVM that is gone
(a killed driver) is deleted unread: its lease lapses after ``leaseTimeout``, as does any
lease whose claim is lost (no listener registered). Claims of a live JVM other than its
own are never touched.

The listener runs in another process than the reader and must connect to the database
to release the lease, so a claim holds the source's ``url``, password included when the
URL has one (a URL without one, the password coming from ``~/.pgpass`` or
``PGPASSWORD``, keeps it out of the claim). Claims are therefore private to the user: they
live in a per-user directory (``keygate-spark-claims-<uid>`` in the temp directory)
created with mode 0700, and one that exists must be a real directory owned by the user
and closed to others, or it is not used at all (no claim is written; nothing in it is
read). Each claim file is created new with mode 0600.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Final

import sqlalchemy as sa
from pyspark.sql import SparkSession
from pyspark.sql.streaming.listener import StreamingQueryListener

from spark import lease
from spark.db import write_engine

log = logging.getLogger(__name__)
CLAIMS: Final = Path(tempfile.gettempdir()) / f"keygate-spark-claims-{os.getuid()}"
_EXIT_WAIT: Final = 5.0
_POLL: Final = 0.1
_registered: set[tuple[int, int]] = set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _private(claims: Path) -> bool:
    """Create ``claims`` with mode 0700, or check that it is the user's own and closed to
    everyone else (warning and False otherwise: such a directory is not used)."""
    with contextlib.suppress(FileExistsError):
        claims.mkdir(mode=0o700)
    info = os.lstat(claims)
    if (
        stat.S_ISDIR(info.st_mode)
        and info.st_uid == os.getuid()
        and not stat.S_IMODE(info.st_mode) & 0o077
    ):
        return True
    log.warning(
        "not using %s for keygate stream claims: it must be a directory of uid %d with mode "
        "0700 (a stopped stream's lease now lapses after leaseTimeout)",
        claims,
        os.getuid(),
    )
    return False


def claim(url: str, queue: str, group: str, owner: str) -> None:
    """Record that this reader process holds the lease (called once it took it)."""
    if not _private(CLAIMS):
        return
    path = CLAIMS / f"{os.getppid()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
    body = {"url": url, "queue": queue, "group": group, "owner": owner}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        json.dump(body, file)


def release_ended(jvm: int, wait: float = _EXIT_WAIT) -> int:
    """Release the leases of ``jvm``'s claims whose reader ended, waiting up to ``wait``
    seconds for readers to end, and delete claims of JVMs that are gone; returns how many
    leases were released."""
    deadline = time.monotonic() + wait
    released = 0
    while CLAIMS.is_dir() and _private(CLAIMS):
        pending = 0
        for path in sorted(CLAIMS.glob("*.json")):
            owner_jvm, reader = (int(part) for part in path.stem.split("-")[:2])
            if owner_jvm == jvm and _alive(reader):
                pending += 1
            elif owner_jvm == jvm:
                released += _release(path)
            elif not _alive(owner_jvm):
                with contextlib.suppress(OSError):
                    path.unlink()
        if pending == 0 or time.monotonic() >= deadline:
            break
        time.sleep(_POLL)
    return released


def _release(path: Path) -> int:
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0
    engine = write_engine(body["url"])
    released = 1
    try:
        with engine.begin() as conn:
            lease.release(conn, body["queue"], body["group"], body["owner"])
    except sa.exc.SQLAlchemyError as e:  # database gone or unreachable: the lease lapses
        log.warning("could not release %s's lease on %s: %s", body["owner"], body["group"], e)
        released = 0
    finally:
        engine.dispose()
    with contextlib.suppress(OSError):
        path.unlink()
    return released


class ReleaseOnTermination(StreamingQueryListener):
    """Releases the group lease of a keygate stream as soon as its query terminates."""

    def __init__(self, jvm: int) -> None:
        self.jvm = jvm

    def onQueryStarted(self, event: Any) -> None:
        pass

    def onQueryProgress(self, event: Any) -> None:
        pass

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryTerminated(self, event: Any) -> None:
        release_ended(self.jvm)


def listen(session: SparkSession) -> None:
    """Add the listener to ``session`` (once)."""
    jvm = int(session._jvm.ProcessHandle.current().pid())  # type: ignore[union-attr]
    if (jvm, id(session)) in _registered:
        return
    session.streams.addListener(ReleaseOnTermination(jvm))
    _registered.add((jvm, id(session)))


__all__ = ["CLAIMS", "ReleaseOnTermination", "claim", "listen", "release_ended"]
