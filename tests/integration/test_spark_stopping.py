"""The claims a keygate stream's reader leaves for the stop listener (spark/stopping.py):
private to the user, and acted on only by the listener of the reader's own JVM.

The reader is played by a child process of the test (its parent, the test, plays the
driver JVM), so the claims are written as a real reader writes them.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

pytest.importorskip("pyspark")

from spark import lease, stopping
from spark.db import ensure_group, write_engine
from storage.schema import kg_groups
from tests.support.spark import execute, seed

pytestmark = pytest.mark.spark

UNREACHABLE = "postgresql://keygate:s3cret@127.0.0.1:1/keygate"
FOREIGN_CLAIM = json.dumps({"url": UNREACHABLE, "queue": "q", "group": "g", "owner": "o"})


@pytest.fixture(autouse=True)
def claims(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "claims"
    monkeypatch.setattr(stopping, "CLAIMS", path)
    return path


def claim_as_reader(claims: Path, url: str, group: str = "etl", owner: str = "stream@t/1") -> None:
    """A child process (a reader of this process's "JVM") claims the lease, and ends."""
    code = (
        "import sys; from pathlib import Path; from spark import stopping; "
        "stopping.CLAIMS = Path(sys.argv[1]); stopping.claim(*sys.argv[2:])"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(claims), url, "orders", group, owner], check=True
    )


def ended_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_claim_is_private_to_the_user(claims: Path) -> None:
    claim_as_reader(claims, UNREACHABLE)
    info = os.stat(claims)
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (os.getuid(), 0o700)
    [path] = claims.iterdir()
    info = os.stat(path)
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (os.getuid(), 0o600)


@pytest.mark.parametrize("mode", [0o755, 0o733], ids=["0755", "0733"])
def test_a_claims_directory_open_to_others_is_not_used(
    claims: Path, mode: int, caplog: pytest.LogCaptureFixture
) -> None:
    claims.mkdir()
    claims.chmod(mode)
    planted = claims / f"{os.getpid()}-{ended_pid()}-planted.json"
    planted.write_text(FOREIGN_CLAIM)
    stopping.claim(UNREACHABLE, "orders", "etl", "stream@t/1")
    assert stopping.release_ended(os.getpid(), wait=0) == 0
    assert list(claims.iterdir()) == [planted]  # nothing written, nothing read
    assert "not using" in caplog.text


def test_a_symlink_for_the_claims_directory_is_not_used(
    claims: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    claims.symlink_to(target)
    stopping.claim(UNREACHABLE, "orders", "etl", "stream@t/1")
    assert list(target.iterdir()) == []
    assert "not using" in caplog.text


def test_the_listener_releases_only_its_own_jvms_ended_claims(
    claims: Path, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    seed(db_url, "orders", 3)
    engine = write_engine(db_url)
    with engine.begin() as conn:
        ensure_group(conn, "orders", "etl", time.time())
        lease.acquire(conn, "orders", "etl", "stream@t/1", 60, time.time())
    engine.dispose()
    claim_as_reader(claims, db_url)
    # Left by a JVM that is gone, and by one that still runs (pid 1): neither is acted on.
    gone = claims / f"{ended_pid()}-{ended_pid()}-gone.json"
    live = claims / f"1-{ended_pid()}-live.json"
    for path in (gone, live):
        path.write_text(FOREIGN_CLAIM)
    with caplog.at_level(logging.WARNING):
        assert stopping.release_ended(os.getpid(), wait=0) == 1
    assert "could not release" not in caplog.text  # no connection to the other database
    assert list(claims.iterdir()) == [live]
    holder = execute(db_url, sa.select(kg_groups.c.lease_owner))
    assert [row.lease_owner for row in holder] == [None]
