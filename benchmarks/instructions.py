"""The gateway's work per message in CPU instructions, counted by valgrind: a measure that
does not move with the machine's speed, so two versions can be compared on a shared,
noisy machine where throughput and CPU seconds move by ±30 % from run to run.

    .venv/bin/python -m benchmarks.instructions --messages 1000
    .venv/bin/python -m benchmarks.instructions --messages 1000 --runs 3

One message's path through the gateway, in one process, without sockets: the broker's
``publish_each`` (routing, validation, building the message) in lots of LOT
publications with up to LOTS in flight, the append writer (group commit, the SQLite
transaction with its fsync), then one consumer bound with client acks and a window of
WINDOW: the group runtime reads the messages back, each delivery is encoded as a native
DELIVER frame, and acks go back in batches of ACK_BATCH. ``--worker N`` runs that for N
messages; without it, this module runs the worker under ``valgrind --tool=callgrind``
for N and for 2N messages (PYTHONHASHSEED fixed) and prints the difference divided by
N: the instructions of one message published, delivered and acked, start-up and imports
cancelled out. The garbage collector is set up as ``keygate serve`` sets it up. Both
runs take a few minutes: Python runs about 50 times slower under valgrind. Instructions
spent waiting (the GIL, epoll, fsync) are not counted; what the kernel does is not
either.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Awaitable, Sequence
from typing import Final

from core.actions import Deliver as Delivery
from core.errors import KeygateError
from core.model import AckMode, Publication, QueueConfig
from gateway.broker import Broker
from gateway.config import GatewayConfig
from gateway.metrics import Metrics
from gateway.server import tune_collector
from protocols.native.encoding import append_deliver
from protocols.native.events import DEFAULT_MAX_FRAME
from protocols.sink import Ack, BindRequest, Principal, Receipt
from storage import open_store

PAYLOAD: Final = bytes(range(256)) * 4  # 1 KiB, the same in every run
KEYS: Final = 1000
PARTITIONS: Final = 16
LOT: Final = 100
LOTS: Final = 10
WINDOW: Final = 2000
ACK_BATCH: Final = 256


class _Output:
    """A consumer's connection without the socket: encodes each run of deliveries as the
    native listener does and keeps their message ids for the ack."""

    def __init__(self) -> None:
        self.unacked: list[str] = []
        self.delivered = 0
        self.arrived = asyncio.Event()

    def deliver(self, deliveries: Sequence[Delivery]) -> Sequence[Delivery]:
        out = bytearray()
        for d in deliveries:
            append_deliver(
                out, d.flow_id, d.message, d.delivery_count, d.redelivered, DEFAULT_MAX_FRAME
            )
            self.unacked.append(d.message.message_id)
        self.delivered += len(deliveries)
        self.arrived.set()
        return ()

    def partitions_changed(self, partitions: frozenset[int]) -> None:
        pass

    def terminate(self, error: KeygateError) -> None:
        raise error


async def _publish(broker: Broker, principal: Principal, messages: int) -> None:
    # One publication per key, published again and again (they are immutable): building
    # them is the client's work, not the gateway's.
    keyed = [
        Publication(PAYLOAD, queue="bench", key=f"key-{i}", producer="native:bench")
        for i in range(KEYS)
    ]
    pending: deque[Awaitable[list[Receipt | KeygateError]]] = deque()
    for start in range(0, messages, LOT):
        lot = [keyed[i % KEYS] for i in range(start, min(start + LOT, messages))]
        pending.append(broker.publish_each(principal, lot))
        if len(pending) >= LOTS:
            _check(await pending.popleft())
    while pending:
        _check(await pending.popleft())


def _check(outcomes: list[Receipt | KeygateError]) -> None:
    refused = [outcome for outcome in outcomes if isinstance(outcome, KeygateError)]
    if refused:
        raise refused[0]


async def _consume(broker: Broker, principal: Principal, messages: int) -> int:
    output = _Output()
    request = BindRequest("bench", "bench", "bench", window=WINDOW, ack_mode=AckMode.CLIENT)
    bound = await broker.bind(principal, request, output)
    while output.delivered < messages or output.unacked:
        if not output.unacked:
            output.arrived.clear()
            await asyncio.wait_for(output.arrived.wait(), 30)
            continue
        batch, output.unacked = output.unacked[:ACK_BATCH], output.unacked[ACK_BATCH:]
        broker.settle(principal, bound.flow_id, Ack(tuple(batch)))
        await asyncio.sleep(0)  # let the runtime send what the acks made room for
    return output.delivered


async def work(messages: int) -> int:
    """Publish ``messages`` and consume them, in this process (the measured part); returns
    how many deliveries were acked."""
    with tempfile.TemporaryDirectory() as tmp:
        store = await open_store(f"sqlite:///{tmp}/bench.db")
        broker = Broker(store, GatewayConfig(), Metrics())
        try:
            await broker.start()
            await broker.create_queue(QueueConfig("bench", partitions=PARTITIONS))
            tune_collector()
            principal = Principal(None, "native", "bench", connection="native:bench")
            await _publish(broker, principal, messages)
            return await _consume(broker, principal, messages)
        finally:
            await broker.close()
            await store.close()


def instructions(messages: int) -> int:
    """Instructions of a worker run of ``messages``, counted by callgrind."""
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={tmp}/callgrind.out",
                sys.executable,
                "-m",
                "benchmarks.instructions",
                "--worker",
                str(messages),
            ],
            env={**os.environ, "PYTHONHASHSEED": "0"},
            capture_output=True,
            text=True,
            check=False,
        )
    found = re.search(r"Collected : (\d+)", run.stderr)
    if run.returncode != 0 or found is None:
        raise SystemExit(f"the worker failed under valgrind:\n{run.stderr[-2000:]}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=1, help="pairs of runs (each printed)")
    parser.add_argument("--worker", type=int, metavar="N", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        acked = asyncio.run(work(args.worker))
        print(f"{args.worker} published, {acked} delivered and acked")
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (Debian package valgrind)")
    for _ in range(args.runs):
        once = instructions(args.messages)
        twice = instructions(2 * args.messages)
        per_message = (twice - once) / args.messages
        print(
            f"{per_message:,.0f} instructions per message published, delivered and acked "
            f"(SQLite; {args.messages:,} and {2 * args.messages:,} messages: "
            f"{once:,} and {twice:,})",
            flush=True,
        )


if __name__ == "__main__":
    main()
