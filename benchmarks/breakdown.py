"""Where the CPU of the native benchmark goes, process by process: the gateway's event
loop, the gateway's other threads (the writer, the delivery reads' driver threads), the
PostgreSQL sessions serving the gateway, and the client — what ``benchmarks.native``
sums up as "server CPU", taken apart.

    .venv/bin/python -m benchmarks.breakdown --messages 100000 --partitions 256
    .venv/bin/python -m benchmarks.breakdown --messages 100000 --partitions 256 \\
        --postgres postgresql://postgres@127.0.0.1:5432/test

The run is ``benchmarks.native``'s (1 KiB messages, 1,000 keys, 1,000 confirmed publishes
in flight, then one client-ack consumer with a window of 2,000), on SQLite or, with
``--postgres``, on PostgreSQL in a schema of its own. For each phase it prints the CPU
seconds per 100,000 messages of each part, read from ``/proc`` before and after the
phase: ``/proc/PID/task/*`` for the gateway's threads (its main thread runs the event
loop), the PostgreSQL backends whose clients are the gateway's own connections (their
ports, in ``pg_stat_activity``) for PostgreSQL, ``getrusage`` for the client (this
process). It found that PostgreSQL's own CPU tripled at 256 partitions while the
gateway's grew by half (docs/performance.md, *Eleventh session*). PostgreSQL must run on
this machine for its processes to be read.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import psycopg

from benchmarks.cpu import cpu_seconds, stat_seconds
from benchmarks.native import consume_rate, gateway, libpq_url, postgres_target, publish_rate
from gateway.client import Client
from storage.engine import GATEWAY_APPLICATION

T = TypeVar("T")
PARTS = ("event loop", "other threads", "PostgreSQL", "client")


def _gateway_threads(pid: int) -> tuple[float, float]:
    """CPU seconds of the gateway's main thread and of all its other threads."""
    main = others = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            seconds = stat_seconds(task / "stat")
        except OSError:
            continue  # a thread that ended meanwhile
        if task.name == str(pid):
            main = seconds
        else:
            others += seconds
    return main, others


def _local_ports(pid: int) -> set[int]:
    """The local ports of the TCP sockets process ``pid`` holds (its connections' ends)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _postgres_sessions(url: str | None, gateway_pid: int) -> dict[int, float]:
    """CPU seconds of each PostgreSQL backend serving this gateway (its connections'
    ports, not another gateway's), by backend pid."""
    if url is None:
        return {}
    ports = sorted(_local_ports(gateway_pid))
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        pids = [
            pid
            for (pid,) in conn.execute(
                "SELECT pid FROM pg_stat_activity"
                " WHERE application_name = %s AND client_port = ANY(%s)",
                (GATEWAY_APPLICATION, ports),
            )
        ]
    seconds = {}
    for pid in pids:
        try:
            seconds[pid] = cpu_seconds(pid)
        except OSError:
            continue  # not on this machine, or gone
    return seconds


def _client() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def measured(
    pid: int, postgres: str | None, messages: int, run: Callable[[], Awaitable[T]]
) -> tuple[T, dict[str, float]]:
    """Await ``run()``; also return each part's CPU seconds per 100k ``messages``."""
    main, others = _gateway_threads(pid)
    sessions, client = _postgres_sessions(postgres, pid), _client()
    result = await run()
    main_after, others_after = _gateway_threads(pid)
    client_after = _client()
    sessions_after = _postgres_sessions(postgres, pid)
    spent = {
        "event loop": main_after - main,
        "other threads": others_after - others,
        # A session opened during the phase counts from zero.
        "PostgreSQL": sum(s - sessions.get(p, 0.0) for p, s in sessions_after.items()),
        "client": client_after - client,
    }
    return result, {part: seconds * 100_000 / messages for part, seconds in spent.items()}


def report(phase: str, rate: float, parts: dict[str, float], postgres: bool) -> str:
    shown = [p for p in PARTS if postgres or p != "PostgreSQL"]
    cpu = ", ".join(f"{part} {parts[part]:.2f}" for part in shown)
    return f"{phase:8s} {rate:8.0f} msg/s | CPU s per 100k: {cpu}"


async def run(url: str, pid: int, args: argparse.Namespace, postgres: str | None) -> None:
    queue = "bench-" + uuid.uuid4().hex[:8]
    async with Client(url) as admin:
        await admin.declare_queue(queue, partitions=args.partitions)
    rate, parts = await measured(
        pid, postgres, args.messages, lambda: publish_rate(url, queue, args.messages)
    )
    print(report("publish", rate, parts, postgres is not None), flush=True)
    await asyncio.sleep(args.settle)  # let the publish phase's housekeeping finish first
    rate, parts = await measured(
        pid, postgres, args.messages, lambda: consume_rate(url, queue, args.messages)
    )
    print(report("consume", rate, parts, postgres is not None), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--postgres", metavar="URL", help="run on PostgreSQL (default SQLite)")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds between phases")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        db = f"sqlite:///{tmp}/bench.db"
        if args.postgres:
            db = stack.enter_context(postgres_target(args.postgres))
        name = "postgresql" if args.postgres else "sqlite"
        print(f"{name}, {args.partitions} partitions, {args.messages} messages")
        with gateway(db) as (url, pid):
            asyncio.run(run(url, pid, args, args.postgres))


if __name__ == "__main__":
    main()
