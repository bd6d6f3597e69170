"""Backlog benchmark: publish a large backlog into a fresh store as fast as the gateway
confirms it, then consume part of it, watching the gateway's memory and its lease.

    .venv/bin/python -m benchmarks.backlog --messages 10000000
    .venv/bin/python -m benchmarks.backlog --messages 2000000 --postgres postgresql://...

Every ``--chunk`` messages it prints the publish rate of that chunk and the gateway's
resident memory (VmRSS); at the end, the consume rate and memory after reading
``--consume`` messages from the head of the backlog. It stops with an error if the
gateway exits (a 10M-message flood on SQLite once made it lose its lease:
docs/operations.md, *Writes keep the lease*). The gateway's log goes to ``--log``.
Needs about 1.6 GB of disk per million 1 KiB messages on SQLite.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.native import consume_rate, gateway, postgres_target, publish_rate
from gateway.client import Client


def rss_mb(pid: int) -> float:
    """The process's resident memory now (VmRSS), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"process {pid} has exited")


async def run(url: str, pid: int, messages: int, chunk: int, consume: int) -> None:
    queue = "backlog-" + uuid.uuid4().hex[:8]
    async with Client(url) as admin:
        await admin.declare_queue(queue, partitions=16)
    started = time.monotonic()
    published = 0
    while published < messages:
        count = min(chunk, messages - published)
        rate = await publish_rate(url, queue, count)
        published += count
        print(
            f"{published:>11,} published | {rate:8.0f} msg/s | gateway RSS "
            f"{rss_mb(pid):5.0f} MB | {time.monotonic() - started:6.0f} s",
            flush=True,
        )
    rate = await consume_rate(url, queue, consume)
    print(f"consumed {consume:,}: {rate:.0f} msg/s | gateway RSS {rss_mb(pid):.0f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=10_000_000)
    parser.add_argument("--chunk", type=int, default=100_000)
    parser.add_argument("--consume", type=int, default=200_000)
    parser.add_argument("--postgres", help="run on PostgreSQL (a fresh schema) instead")
    parser.add_argument("--log", default="backlog-gateway.log", help="the gateway's log")
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(dir=os.environ.get("KEYGATE_BENCH_DIR")) as tmp,
        contextlib.ExitStack() as stack,
    ):
        db = f"sqlite:///{tmp}/backlog.db"
        if args.postgres:
            db = stack.enter_context(postgres_target(args.postgres))
        with open(args.log, "w") as log, gateway(db, stderr=log) as (url, pid):
            asyncio.run(run(url, pid, args.messages, args.chunk, args.consume))


if __name__ == "__main__":
    main()
