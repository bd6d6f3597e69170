"""Native protocol benchmark: confirmed publish throughput, consume throughput with client
acks, and end-to-end latency at a fixed offered rate, on SQLite and PostgreSQL.

    .venv/bin/python benchmarks/native.py --messages 20000
    .venv/bin/python benchmarks/native.py --postgres postgresql://postgres@127.0.0.1:5432/test
    .venv/bin/python benchmarks/native.py --partitions 256 --no-latency
    .venv/bin/python benchmarks/native.py --no-latency --refuse-every 1000

The gateway runs in its own process (``keygate serve``), as in production; its peak
resident memory (VmHWM) is printed with the rates.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import IO

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

from benchmarks.cpu import cpu_per_100k, cpu_text
from core.errors import QueueNotFound
from gateway.client import Client

PAYLOAD = os.urandom(1024)
KEYS = 1000
IN_FLIGHT = 1000


@contextmanager
def gateway(
    db: str,
    stderr: IO[str] | None = None,
    module: str = "gateway.cli",
    *,
    wrapper: Sequence[str] = (),
    patience: float = 30,
    config: Path | None = None,
    mqtt: dict[str, int] | None = None,
) -> Iterator[tuple[str, int]]:
    """A ``keygate serve`` process on ``db`` with the native port only: (its URL, its pid).
    Its log goes to ``stderr`` (discarded by default). ``module``: what runs ``serve``
    (benchmarks.stages runs it with timestamps added); ``wrapper``: a command that runs
    it (benchmarks.native_instructions: valgrind); ``patience``: seconds it may take to
    start, and to stop once told to; ``config``: its TOML configuration file; ``mqtt``: a
    dict given opens the MQTT port too, and gets its number as ``mqtt["port"]``."""
    with tempfile.TemporaryDirectory() as tmp:
        ports = Path(tmp) / "ports.json"
        proc = subprocess.Popen(
            [
                *wrapper,
                sys.executable,
                "-m",
                module,
                "serve",
                "--db",
                db,
                "--host",
                "127.0.0.1",
                "--native-port",
                "0",
                "--http-port",
                "off",
                "--mqtt-port",
                "off" if mqtt is None else "0",
                "--amqp-port",
                "off",
                "--stomp-port",
                "off",
                "--ports-file",
                str(ports),
                *(["--config", str(config)] if config is not None else []),
            ],
            stderr=subprocess.DEVNULL if stderr is None else stderr,
        )
        try:
            deadline = time.monotonic() + patience
            while not ports.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the gateway did not start")
                time.sleep(0.05)
            opened = json.loads(ports.read_text())
            if mqtt is not None:
                mqtt["port"] = opened["mqtt"]
            yield f"keygate://127.0.0.1:{opened['native']}", proc.pid
        finally:
            proc.terminate()
            proc.wait(patience)


async def publish_rate(
    url: str, queue: str, count: int, keys: int = KEYS, refuse_every: int = 0
) -> float:
    """IN_FLIGHT publishers on one connection, each publishing its share one confirmed
    message at a time (IN_FLIGHT coroutines, not one per message: the load generator
    should cost the client little). With ``refuse_every`` N, every Nth publish names a
    queue that does not exist and is refused (counted in the rate: it was answered)."""
    async with Client(url) as client:

        async def publisher(first: int) -> None:
            for i in range(first, count, IN_FLIGHT):
                if refuse_every and i % refuse_every == refuse_every - 1:
                    with contextlib.suppress(QueueNotFound):
                        await client.publish(queue + "-missing", PAYLOAD, key=f"key-{i % keys}")
                    continue
                await client.publish(queue, PAYLOAD, key=f"key-{i % keys}")

        started = time.perf_counter()
        await asyncio.gather(*(publisher(first) for first in range(IN_FLIGHT)))
        return count / (time.perf_counter() - started)


async def consume_rate(url: str, queue: str, count: int) -> float:
    async with Client(url) as client:
        consumer = await client.subscribe(queue, group="bench", window=2000)
        started = time.perf_counter()
        for _ in range(count):
            msg = await consumer.receive(timeout=30)
            await consumer.acknowledge(msg)
        rate = count / (time.perf_counter() - started)
        await consumer.close()
        return rate


async def paced(rate: int, seconds: float) -> AsyncIterator[int]:
    """0, 1, ... up to ``rate * seconds``, each at its time on a fixed offered rate."""
    start = time.perf_counter()
    for i in range(int(rate * seconds)):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield i


async def publish_at(url: str, queue: str, rate: int, seconds: float) -> None:
    """Publish ``rate * seconds`` confirmed messages at a fixed offered rate, each
    stamped with its send time."""
    async with Client(url) as producer:
        # Done publishes leave the set: keeping every task alive made the client's own
        # garbage collector stall it for ~130 ms near the end of a 5,000 msg/s run.
        pending: set[asyncio.Task[str]] = set()
        async for i in paced(rate, seconds):
            task = asyncio.create_task(
                producer.publish(
                    queue, PAYLOAD, key=f"key-{i % KEYS}", properties={"sent": repr(time.time())}
                )
            )
            pending.add(task)
            task.add_done_callback(pending.discard)
        await asyncio.gather(*pending)


def _publisher(url: str, queue: str, rate: int, seconds: float) -> None:
    asyncio.run(publish_at(url, queue, rate, seconds))


def publisher_process(target: Callable[..., None], *args: object) -> BaseProcess:
    """The publisher of a latency run in a process of its own: in the consumer's process
    at 5,000 msg/s one Python event loop doing both measured itself, not the server."""
    process = multiprocessing.get_context("spawn").Process(target=target, args=args)
    process.start()
    return process


async def latency(
    url: str,
    queue: str,
    rate: int,
    seconds: float,
    timeline: list[tuple[float, float]] | None = None,
) -> tuple[float, float]:
    """(p50, p99) ms of a latency run; ``timeline`` gets each message's (send time,
    latency in seconds)."""
    async with Client(url) as consuming:
        consumer = await consuming.subscribe(queue, group="latency", window=2000, start="latest")
        samples: list[float] = []
        publisher = publisher_process(_publisher, url, queue, rate, seconds)
        try:
            for _ in range(int(rate * seconds)):
                msg = await consumer.receive(timeout=60)
                sent = float(msg.properties["sent"])
                samples.append(time.time() - sent)
                if timeline is not None:
                    timeline.append((sent, samples[-1]))
                await consumer.acknowledge(msg)
        finally:
            await asyncio.to_thread(publisher.join, 60)
        return percentiles(samples)


def percentiles(samples: list[float]) -> tuple[float, float]:
    """(p50, p99) of latencies in seconds, in milliseconds."""
    samples.sort()
    return statistics.median(samples) * 1000, samples[int(len(samples) * 0.99) - 1] * 1000


def libpq_url(url: str) -> str:
    """A PostgreSQL URL as psycopg takes it: no SQLAlchemy driver name, no search_path."""
    bare = make_url(url).set(drivername="postgresql").difference_update_query(["search_path"])
    return bare.render_as_string(hide_password=False)


@contextmanager
def postgres_target(url: str, prefix: str = "kg_bench_") -> Iterator[str]:
    """``url`` with a fresh schema of its own (named ``prefix`` and a random suffix) as
    the search path; the schema is dropped afterwards, and the run's messages with it (a
    run leaves no gigabytes behind). The tests' ``postgres_url`` fixture is one too."""
    schema = prefix + uuid.uuid4().hex[:12]
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    try:
        yield (
            make_url(url)
            .update_query_dict({"search_path": schema})
            .render_as_string(hide_password=False)
        )
    finally:
        with psycopg.connect(libpq_url(url), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory (VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def run(
    url: str,
    pid: int,
    messages: int,
    partitions: int,
    rate: int | None,
    keys: int,
    refuse_every: int = 0,
) -> dict[str, float | None]:
    queue = "bench-" + uuid.uuid4().hex[:8]
    async with Client(url) as admin:
        await admin.declare_queue(queue, partitions=partitions)
    out: dict[str, float | None] = {}
    out["publish_msgs_s"], out["publish_cpu"] = await cpu_per_100k(
        pid, messages, publish_rate(url, queue, messages, keys, refuse_every)
    )
    stored = messages - (messages // refuse_every if refuse_every else 0)
    out["consume_msgs_s"], out["consume_cpu"] = await cpu_per_100k(
        pid, stored, consume_rate(url, queue, stored)
    )
    if rate is not None:
        out["p50_ms"], out["p99_ms"] = await latency(url, queue, rate, 5.0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--keys", type=int, default=KEYS, help="distinct keys published")
    parser.add_argument("--rate", type=int, default=1000, help="offered rate for latency")
    parser.add_argument("--no-latency", action="store_true", help="skip the latency run")
    parser.add_argument(
        "--refuse-every",
        type=int,
        default=0,
        metavar="N",
        help="every Nth publish names a missing queue (refused alone, amid pipelined ones)",
    )
    parser.add_argument("--postgres", default=os.environ.get("KEYGATE_TEST_POSTGRES_URL"))
    args = parser.parse_args()
    targets = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        targets["sqlite"] = f"sqlite:///{tmp}/bench.db"
        if args.postgres:
            targets["postgresql"] = stack.enter_context(postgres_target(args.postgres))
        for name, db in targets.items():
            with gateway(db) as (url, pid):
                rate = None if args.no_latency else args.rate
                result = asyncio.run(
                    run(
                        url,
                        pid,
                        args.messages,
                        args.partitions,
                        rate,
                        args.keys,
                        args.refuse_every,
                    )
                )
                rss = peak_rss_mb(pid)
                line = (
                    f"{name:10s} {args.partitions} partitions, {args.keys} keys | publish "
                    f"{result['publish_msgs_s']:8.0f} msg/s (confirmed, {IN_FLIGHT} in flight)"
                    f"{cpu_text(result['publish_cpu'])} | consume "
                    f"{result['consume_msgs_s']:8.0f} msg/s (client acks)"
                    f"{cpu_text(result['consume_cpu'])}"
                )
                if rate is not None:
                    line += (
                        f" | e2e latency at {rate} msg/s: "
                        f"p50 {result['p50_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms"
                    )
                print(f"{line} | gateway peak RSS {rss:.0f} MB", flush=True)


if __name__ == "__main__":
    main()
