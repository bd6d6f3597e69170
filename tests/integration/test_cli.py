"""The ``keygate`` command as a user runs it: a real ``keygate serve`` process and the admin
commands against it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from tests.support.serve import ALL_PORTS_FREE, KEYGATE, serve


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KEYGATE, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[dict[str, int]]:
    with serve(f"sqlite:///{tmp_path / 'kg.db'}", tmp_path) as (proc, ports, log):
        yield ports
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()  # graceful shutdown exits cleanly
        assert "gateway stopped" in log.read_text()


def test_serve_writes_every_bound_port_and_admin_commands_work(served: dict[str, int]) -> None:
    assert set(served) == {"native", "mqtt", "amqp", "stomp", "http"}
    url = f"--url=http://127.0.0.1:{served['http']}"
    created = _run(
        "queue",
        "create",
        "orders",
        "--partitions",
        "4",
        "--subscribe",
        "orders/#",
        "--max-deliveries",
        "5",
        url,
    )
    assert created.returncode == 0, created.stderr
    assert json.loads(created.stdout)["max_deliveries"] == 5
    for i in range(3):
        sent = _run("publish", "orders", f"hello {i}", "--key", "customer-1", url)
        assert sent.returncode == 0, sent.stderr
    listed = _run("queue", "list", url)
    assert "orders" in listed.stdout and "orders.dlq" in listed.stdout
    consumed = _run(
        "consume",
        "orders",
        "--group",
        "billing",
        "--count",
        "3",
        f"--server=keygate://127.0.0.1:{served['native']}",
    )
    assert consumed.returncode == 0, consumed.stderr
    lines = [json.loads(line) for line in consumed.stdout.splitlines()]
    assert [m["payload"] for m in lines] == ["hello 0", "hello 1", "hello 2"]
    inspected = json.loads(_run("inspect", "orders", "--json", url).stdout)
    (billing,) = inspected["groups"]
    assert len(billing["partitions"]) == 4
    assert sum(p["committed_seq"] for p in billing["partitions"]) == 3
    table = _run("inspect", "orders", url).stdout
    assert "group billing" in table and "committed_seq" in table


def test_status_shows_the_role_the_version_and_every_listener(served: dict[str, int]) -> None:
    url = f"--url=http://127.0.0.1:{served['http']}"
    shown = _run("status", url)
    assert shown.returncode == 0, shown.stderr
    assert ": active" in shown.stdout.splitlines()[0]
    assert "database sqlite" in shown.stdout
    data = json.loads(_run("status", "--json", url).stdout)
    assert data["listeners"] == served


def test_queue_list_with_no_queues_prints_the_heading_and_succeeds(
    served: dict[str, int],
) -> None:
    """It crashed with a TypeError when the caller could see no queue."""
    listed = _run("queue", "list", f"--url=http://127.0.0.1:{served['http']}")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split() == [
        "name",
        "partitions",
        "depth",
        "bytes",
        "in_flight",
        "dead_letters",
    ]


def test_a_queue_is_altered_and_purged_from_the_command_line(served: dict[str, int]) -> None:
    url = f"--url=http://127.0.0.1:{served['http']}"
    assert _run("queue", "create", "jobs", "--partitions", "2", url).returncode == 0
    altered = _run(
        "queue",
        "alter",
        "jobs",
        "--max-deliveries",
        "3",
        "--subscribe",
        "jobs/#",
        "--rebalance-delay",
        "1.5",
        url,
    )
    assert altered.returncode == 0, altered.stderr
    settings = json.loads(altered.stdout)
    assert (settings["max_deliveries"], settings["rebalance_delay"]) == (3, 1.5)
    assert settings["subscriptions"] == ["jobs/#"]
    refused = _run("queue", "alter", "jobs", "--partitions", "4", url)
    assert refused.returncode == 1 and "invalid-argument" in refused.stderr
    refused = _run("queue", "alter", "jobs", "--window", str(2**40), url)
    assert refused.returncode == 1 and "window must be between 1 and 2147483647" in refused.stderr
    for i in range(3):
        assert _run("publish", "--topic", "jobs/eu", f"job {i}", "--key", "k", url).returncode == 0
    browsed = _run("queue", "browse", "jobs", "--json", url)
    assert [m["payload"] for m in json.loads(browsed.stdout)] == ["job 0", "job 1", "job 2"]
    (partition,) = {m["partition"] for m in json.loads(browsed.stdout)}
    table = _run("queue", "browse", "jobs", f"--partition={partition}", "--from-seq=2", url)
    assert [line.split()[-2:] for line in table.stdout.splitlines()[1:]] == [
        ["job", "1"],
        ["job", "2"],
    ]
    purged = _run("queue", "purge", "jobs", url)
    assert json.loads(purged.stdout) == {"purged": "jobs", "messages": 3}
    shown = json.loads(_run("queue", "show", "jobs", url).stdout)
    assert shown["depth"] == 0 and shown["max_deliveries"] == 3


def test_groups_are_created_listed_and_deleted_with_their_settings(
    served: dict[str, int],
) -> None:
    url = f"--url=http://127.0.0.1:{served['http']}"
    assert _run("queue", "create", "jobs", url).returncode == 0
    created = _run(
        "group",
        "create",
        "jobs",
        "workers",
        "--key-order",
        "strict",
        "--start",
        "latest",
        "--tag",
        "region=eu",
        "--ack-timeout",
        "30",
        url,
    )
    assert created.returncode == 0, created.stderr
    assert json.loads(created.stdout) == {
        "queue": "jobs",
        "name": "workers",
        "mode": "shared",
        "key_order": "strict",
        "start": "latest",
        "tags": {"region": "eu"},
        "ack_timeout": 30.0,
    }
    again = _run("group", "create", "jobs", "workers", url)
    assert again.returncode == 1 and "already-exists" in again.stderr
    assert "workers" in _run("group", "list", "jobs", url).stdout
    assert _run("group", "delete", "jobs", "workers", url).returncode == 0
    assert "workers" not in _run("group", "list", "jobs", url).stdout
    missing = _run("group", "delete", "jobs", "workers", url)
    assert missing.returncode == 1 and "group-not-found" in missing.stderr


def test_a_taken_port_fails_fast_naming_the_port_and_the_flag(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run(
            "serve",
            "--db",
            f"sqlite:///{tmp_path / 'kg.db'}",
            "--host",
            "127.0.0.1",
            *ALL_PORTS_FREE,
            f"--stomp-port={port}",
        )
    assert result.returncode == 1
    assert f"127.0.0.1:{port} is already in use" in result.stderr
    assert "--stomp-port" in result.stderr


@pytest.mark.parametrize(
    ("toml", "env", "named"),
    [
        ('lease_ttl = "abc"\n', {}, "cfg.toml:lease_ttl"),
        ("lease_ttl = -1\n", {}, "cfg.toml:lease_ttl"),
        ("users = 5\n", {}, "cfg.toml:users"),
        ("", {"KEYGATE_LOG_JSON": "on-ish"}, "KEYGATE_LOG_JSON"),
        ("", {"KEYGATE_MAX_CONNECTIONS": "many"}, "KEYGATE_MAX_CONNECTIONS"),
    ],
)
def test_a_bad_setting_is_one_line_and_exit_2_before_anything_starts(
    tmp_path: Path, toml: str, env: dict[str, str], named: str
) -> None:
    config, db, ports_file = tmp_path / "cfg.toml", tmp_path / "kg.db", tmp_path / "ports.json"
    config.write_text(toml)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KEYGATE_")}
    result = subprocess.run(
        [
            *KEYGATE,
            *("serve", "--config", str(config), "--db", f"sqlite:///{db}"),
            *("--host", "127.0.0.1", *ALL_PORTS_FREE, "--ports-file", str(ports_file)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **env},
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("keygate: "), result.stderr
    assert named in result.stderr
    assert result.stdout == ""
    assert not db.exists() and not ports_file.exists()  # no database touched, nothing served


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("part", "value", "named"),
    [
        ("database", "nosuchdb", 'database "nosuchdb" does not exist'),
        ("username", "nosuchuser", 'role "nosuchuser" does not exist'),
    ],
)
def test_a_database_url_the_server_refuses_fails_fast_with_exit_2_naming_it(
    postgres_url: str, tmp_path: Path, part: str, value: str, named: str
) -> None:
    """A configuration error only the database can tell, not an outage to wait out: it
    was 'cannot migrate the database' and exit 1, with SQLAlchemy's text."""
    url = make_url(postgres_url).set(**{part: value}).render_as_string(hide_password=False)
    started = time.monotonic()
    result = _run("serve", "--db", url, "--host", "127.0.0.1", *ALL_PORTS_FREE)
    assert result.returncode == 2, result.stderr
    assert time.monotonic() - started < 30
    assert "Traceback" not in result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith("keygate: the database refuses the gateway's sessions: "), last
    assert named in last and "check the user, password and database" in last, last


def test_admin_commands_explain_an_unreachable_gateway() -> None:
    result = _run("queue", "list", "--url=http://127.0.0.1:9")
    assert result.returncode == 1
    assert "cannot reach the gateway's admin API" in result.stderr


@pytest.mark.parametrize(
    ("args", "code", "error"),
    [
        (["publish", "q", "x", "--property", "noequals"], 1, "--property takes NAME=VALUE"),
        (
            ["consume", "q", "--group", "g", "--server", "keygate://127.0.0.1:1"],
            1,
            "cannot reach the gateway at keygate://127.0.0.1:1",
        ),
        (["consume", "q", "--group", "g", "--window", "-5"], 2, "between 1 and 2147483647"),
        (["consume", "q", "--group", "g", "--window", str(2**31)], 2, "between 1 and 2147483647"),
        (["dlq", "redrive", "q.dlq", "--limit", "0"], 2, "argument --limit: must be at least 1"),
        (["dlq", "redrive", "q.dlq", "--limit", "-1"], 2, "argument --limit: must be at least 1"),
        (["queue", "browse", "q", "--limit", "0"], 2, "argument --limit: must be at least 1"),
        (["queue", "browse", "q", "--partition", "-1"], 2, "--partition: must be at least 0"),
    ],
)
def test_bad_arguments_are_refused_in_one_line_without_a_traceback(
    args: list[str], code: int, error: str
) -> None:
    url = [] if args[0] == "consume" else ["--url=http://127.0.0.1:9"]  # never reached
    result = _run(*args, *url)
    assert result.returncode == code, result.stderr
    assert error in result.stderr and "Traceback" not in result.stderr
    if code == 1:
        assert result.stderr.count("\n") == 1, result.stderr


def test_key_release_under_a_missing_queue_says_the_queue_is_missing(
    served: dict[str, int],
) -> None:
    result = _run("key", "release", "nosuch", "g", "k", f"--url=http://127.0.0.1:{served['http']}")
    assert result.returncode == 1
    assert "queue-not-found" in result.stderr


def test_demo_runs_and_verifies(tmp_path: Path) -> None:
    result = subprocess.run(
        [*KEYGATE, "demo", "--messages", "400"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "verification: per-key order held" in result.stdout
