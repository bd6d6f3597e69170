"""AMQP benchmark: confirmed publish throughput with aio-pika, keygate against RabbitMQ.

Each run publishes ``--messages`` 1 KB persistent messages carrying one of 1,000 keys in
a ``JMSXGroupID`` header, with up to 1,000 publisher confirms in flight, to a durable queue
on each server in turn, and prints messages/s, the keygate/RabbitMQ ratio and each
server's CPU seconds per 100k messages (utime + stime from /proc/<pid>/stat).

    # a running gateway (e.g. keygate serve) against the local RabbitMQ
    .venv/bin/python -m benchmarks.amqp --keygate 127.0.0.1:5673 --keygate-pid 1234
    # the AMQP listener alone, on a sink that stores nothing, in a subprocess
    .venv/bin/python -m benchmarks.amqp --self-contained

RabbitMQ is expected on 127.0.0.1:5672 with guest/guest (``--rabbitmq off`` skips it);
its process is found by name (beam.smp) unless ``--rabbitmq-pid`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from asyncio.subprocess import PIPE
from dataclasses import dataclass
from pathlib import Path

import aio_pika
from pamqp.common import Arguments

from benchmarks.cpu import cpu_per_100k, find_pid

PAYLOAD = os.urandom(1024)
KEYS = 1000
IN_FLIGHT = 1000
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    name: str
    rate: float
    cpu_per_100k: float | None


async def publish_confirmed(url: str, count: int, arguments: Arguments) -> float:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        queue_name = f"bench-{uuid.uuid4().hex[:12]}"
        queue = await channel.declare_queue(queue_name, durable=True, arguments=arguments)
        slots = asyncio.Semaphore(IN_FLIGHT)
        exchange = channel.default_exchange

        async def one(i: int) -> None:
            try:
                await exchange.publish(
                    aio_pika.Message(
                        PAYLOAD,
                        headers={"JMSXGroupID": f"key-{i % KEYS}"},
                        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    ),
                    routing_key=queue_name,
                )
            finally:
                slots.release()

        started = time.perf_counter()
        tasks = []
        for i in range(count):
            await slots.acquire()
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
        await queue.delete(if_unused=False, if_empty=False)
    return count / elapsed


async def measure(name: str, url: str, pid: int | None, count: int, arguments: Arguments) -> Result:
    await publish_confirmed(url, min(count, 2000), arguments)  # warm-up
    rate, cpu = await cpu_per_100k(pid, count, publish_confirmed(url, count, arguments))
    return Result(name, rate, cpu)


def serve_noop() -> None:
    """Subprocess mode: an AmqpListener on a sink that acknowledges without storing."""
    from benchmarks.nullsink import NullSink
    from protocols.amqp import AmqpListener

    async def run() -> None:
        listener = AmqpListener(NullSink())
        port = await listener.start("127.0.0.1", 0, None)
        print(port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await listener.close()

    asyncio.run(run())


def report(results: list[Result]) -> None:
    for result in results:
        cpu = "n/a" if result.cpu_per_100k is None else f"{result.cpu_per_100k:.1f} s"
        print(f"{result.name:>28}: {result.rate:>9.0f} msg/s   server CPU per 100k: {cpu}")
    if len(results) == 2 and results[1].rate:
        print(f"{'keygate / RabbitMQ':>28}: {results[0].rate / results[1].rate:.2f}x")


async def main(args: argparse.Namespace) -> None:
    results = []
    keygate_args: Arguments = {"x-partitions": args.partitions}
    if args.self_contained:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "benchmarks.amqp",
            "--serve-noop",
            stdin=PIPE,
            stdout=PIPE,
            cwd=ROOT,
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            port = int(await proc.stdout.readline())
            url = f"amqp://guest:guest@127.0.0.1:{port}/"
            name = "keygate AMQP, no-op sink"
            results.append(await measure(name, url, proc.pid, args.messages, keygate_args))
        finally:
            proc.stdin.close()
            await proc.wait()
    else:
        url = f"amqp://{args.user}:{args.password}@{args.keygate}/"
        results.append(await measure("keygate", url, args.keygate_pid, args.messages, keygate_args))
    if args.rabbitmq != "off":
        pid = args.rabbitmq_pid or find_pid("beam.smp")
        url = f"amqp://guest:guest@{args.rabbitmq}/"
        results.append(await measure("RabbitMQ", url, pid, args.messages, None))
    report(results)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve-noop"]:
        serve_noop()
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--keygate", metavar="HOST:PORT", help="a running keygate AMQP port")
    target.add_argument("--self-contained", action="store_true")
    parser.add_argument("--keygate-pid", type=int, help="the keygate process, for CPU time")
    parser.add_argument("--rabbitmq", default="127.0.0.1:5672", help="HOST:PORT or 'off'")
    parser.add_argument("--rabbitmq-pid", type=int)
    parser.add_argument("--user", default="guest")
    parser.add_argument("--password", default="guest")
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--partitions", type=int, default=16)
    asyncio.run(main(parser.parse_args()))
