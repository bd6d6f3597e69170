"""Releasing a stopped stream's group lease at once.

PySpark never calls a Python streaming source's ``stop()``. The stream reader runs in a
Python process that the driver's JVM starts for the query and ends when the query stops.
So the reader, once it holds a lease, leaves a claim file in the temp directory naming
the driver JVM (its parent process), itself, and the lease (url, queue, group, owner).
``spark.register(session)`` adds a StreamingQueryListener; when a query terminates it
releases the lease of every claim of this JVM whose reader process has ended (waiting up
to ``_EXIT_WAIT`` seconds for it), and deletes the claim. Claims of a JVM that is gone are
cleaned up the same way. A lease whose claim is lost (no listener registered, driver
killed) still lapses after ``leaseTimeout``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
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
CLAIMS: Final = Path(tempfile.gettempdir()) / "keygate-spark-claims"
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


def claim(url: str, queue: str, group: str, owner: str) -> None:
    """Record that this reader process holds the lease (called once it took it)."""
    CLAIMS.mkdir(parents=True, exist_ok=True)
    path = CLAIMS / f"{os.getppid()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
    body = {"url": url, "queue": queue, "group": group, "owner": owner}
    path.write_text(json.dumps(body), encoding="utf-8")


def release_ended(jvm: int, wait: float = _EXIT_WAIT) -> int:
    """Release the leases of ``jvm``'s claims whose reader ended (or whose JVM did),
    waiting up to ``wait`` seconds for readers to end; returns how many were released."""
    deadline = time.monotonic() + wait
    released = 0
    while True:
        pending = 0
        for path in sorted(CLAIMS.glob("*.json")) if CLAIMS.is_dir() else ():
            owner_jvm, reader = (int(part) for part in path.stem.split("-")[:2])
            if owner_jvm == jvm and _alive(reader):
                pending += 1
            elif owner_jvm == jvm or not _alive(owner_jvm):
                released += _release(path)
        if pending == 0 or time.monotonic() >= deadline:
            return released
        time.sleep(_POLL)


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
