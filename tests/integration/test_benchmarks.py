"""The benchmarks that reach into the gateway still run: benchmarks.stages wraps private
methods of the store and the native listener, and a rename would silently leave stages
unmeasured. A tiny run must reach every stage."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.mqtt_instructions import PHASES as MQTT_PHASES
from benchmarks.mqtt_instructions import phases as mqtt_phases
from benchmarks.native import gateway
from benchmarks.native_instructions import PHASES, phases
from tests.conftest import POSTGRES_ENV


def _benchmark(module: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.MODULE ARGS``, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_stage_benchmark_reaches_every_stage() -> None:
    run = _benchmark("stages", "--rate", "200", "--seconds", "0.5")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("sqlite at 200 msg/s: 100 messages"), run.stdout
    assert len(lines) == 11 and "end to end" in lines[-1], run.stdout
    assert "(not reached)" not in run.stdout, run.stdout


def test_the_latency_benchmark_prints_percentiles_and_its_timeline() -> None:
    """The timeline (the worst latency per 0.25 s of send time) is how a periodic stall
    is told from a steady cost: it found the retention bursts."""
    run = _benchmark(
        "latency", "--rates", "200", "--seconds", "1", "--timeline", "--rabbitmq", "off"
    )
    assert run.returncode == 0, run.stderr
    report, timeline = run.stdout.splitlines()
    assert "keygate sqlite at   200 msg/s: p50" in report, run.stdout
    assert timeline.strip().startswith("worst per 0.25 s of send time (ms): 0.00s "), run.stdout
    assert timeline.count("s ") >= 4, run.stdout  # a second of sending, four buckets


def test_the_instruction_count_workload_publishes_delivers_and_acks_every_message() -> None:
    """benchmarks.instructions drives the broker directly (publish_each, bind, settle);
    its worker, run here without valgrind, must still get every message through."""
    run = _benchmark("instructions", "--worker", "300")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "300 published, 300 delivered and acked", run.stdout


def test_a_benchmark_runs_on_this_checkout_and_a_revision_side_by_side() -> None:
    """benchmarks.against: how the instruction counts of two versions are compared."""
    run = _benchmark("against", "HEAD", "benchmarks.instructions", "--worker", "50", timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("== this checkout") and lines[2] == "== HEAD", run.stdout
    assert lines[1] == lines[3] == "50 published, 50 delivered and acked", run.stdout
    worktrees = subprocess.run(["git", "worktree", "list"], capture_output=True, text=True)
    assert "baseline" not in worktrees.stdout  # removed again


def test_a_revision_that_does_not_exist_is_named_in_a_clear_error() -> None:
    run = _benchmark("against", "no-such-rev", "benchmarks.instructions", timeout=60)
    assert run.returncode != 0 and "cannot check out no-such-rev" in run.stderr, run.stderr


def test_the_native_instruction_count_phases_get_every_message_through(tmp_path: Path) -> None:
    """benchmarks.native_instructions drives a gateway through its phases, telling its
    callgrind when to zero and dump; run here without valgrind, each phase must finish
    (every message confirmed, then delivered and acked) and be marked in order."""
    marks: list[str] = []
    with gateway(f"sqlite:///{tmp_path}/bench.db") as (url, _pid):
        asyncio.run(phases(url, 100, marks.append))
    assert marks == ["--zero", *(f"--dump={phase}" for phase in PHASES)]


def test_the_mqtt_instruction_count_rounds_get_every_publish_acknowledged(
    tmp_path: Path,
) -> None:
    """benchmarks.mqtt_instructions publishes its rounds from many connections at once;
    run here without valgrind, every publish of each round is acknowledged as stored (a
    refusal ends it) and the rounds are marked in order."""
    marks: list[str] = []
    mqtt: dict[str, int] = {}
    with gateway(f"sqlite:///{tmp_path}/bench.db", mqtt=mqtt) as (url, _pid):
        rounds = mqtt_phases(
            url, f"127.0.0.1:{mqtt['port']}", marks.append, messages=300, connections=7, inflight=4
        )
        asyncio.run(rounds)
    assert marks == ["--zero", *(f"--dump={phase}" for phase in MQTT_PHASES)]


@pytest.mark.parametrize(
    "database", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_the_breakdown_names_every_part_of_each_phase(
    database: str, request: pytest.FixtureRequest
) -> None:
    """benchmarks.breakdown finds the gateway's PostgreSQL sessions by their ports: a
    consume phase that read and acked messages must show PostgreSQL CPU spent."""
    options = []
    if database == "postgres":
        request.getfixturevalue("postgres_url")  # skips when PostgreSQL is unreachable
        options = ["--postgres", os.environ[POSTGRES_ENV]]
    run = _benchmark("breakdown", "--messages", "3000", "--settle", "0", *options)
    assert run.returncode == 0, run.stderr
    header, publish, consume = run.stdout.splitlines()
    assert header == f"{'postgresql' if options else 'sqlite'}, 16 partitions, 3000 messages"
    for phase, line in (("publish", publish), ("consume", consume)):
        rate, parts = line.removeprefix(phase).split("|")
        assert float(rate.split()[0]) > 0, line
        spent = dict(part.rsplit(" ", 1) for part in parts.split(": ")[1].split(", "))
        expected = ["event loop", "other threads", *(["PostgreSQL"] if options else []), "client"]
        assert list(spent) == expected, line
        assert float(spent["event loop"]) > 0 and float(spent["client"]) > 0, line
        if options:
            assert float(spent["PostgreSQL"]) > 0, line


def test_the_sqlite_layout_probe_reads_back_every_row_of_each_layout() -> None:
    run = _benchmark("sqlite_layout", "--messages", "2000", "--partitions", "8")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 8, run.stdout  # 2 layouts x 2 page sizes x 1 and 8 partitions
    assert all("(2000 rows)" in line for line in lines), run.stdout
    assert sum(line.startswith("clustered") for line in lines) == 4, run.stdout


def test_the_mqtt_benchmark_publishes_from_many_connections_at_once() -> None:
    """Many devices, each with a small window (``--connections``): every message of every
    connection is acknowledged, and a paho run refuses the option (one client there)."""
    run = _benchmark(
        "mqtt", "--self-contained", "--client", "raw", "--connections", "20",
        "--inflight", "5", "--messages", "2005",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    (line,) = run.stdout.splitlines()
    assert line.startswith("keygate (self-contained)"), run.stdout
    assert " 2005 msgs " in line and "refused 0" in line, run.stdout
    refused = _benchmark("mqtt", "--self-contained", "--connections", "20")
    assert refused.returncode == 2 and "--connections: with --client raw" in refused.stderr


CALLGRIND = """# callgrind format
events: Ir
summary: {total}
fn=main
1 100
cfn=work
calls=2 10
5 {work}
fn=work
10 {half}
fn=work
11 {half}
"""


def test_the_callgrind_reader_counts_each_function_without_its_calls(tmp_path: Path) -> None:
    """callgrind_annotate puts the whole gateway on _PyEval_Vector; benchmarks.callgrind_top
    reads each function's own cost, the calls it made left out, per message, and the
    growth against a base dump first."""
    after, before = tmp_path / "after", tmp_path / "before"
    after.write_text(CALLGRIND.format(total=1000, work=900, half=450))
    before.write_text(CALLGRIND.format(total=700, work=600, half=300))
    run = _benchmark("callgrind_top", str(after), "--per", "10")
    assert run.returncode == 0, run.stderr
    assert [line.split() for line in run.stdout.splitlines()] == [
        ["100", "in", "all"],
        ["90", "work"],
        ["10", "main"],
    ]
    run = _benchmark("callgrind_top", str(after), "--base", str(before), "--per", "10")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].split() == ["100", "in", "all", "(base", "70)"]
    assert lines[1].split() == ["60", "→", "90", "+30", "work"]
