"""The gateway's work per MQTT QoS 1 publish, in CPU instructions counted by valgrind:
what ``benchmarks.mqtt`` measures in CPU seconds, in a unit that does not move with the
machine's speed, so that a change of a few per cent can be told from the noise.

    .venv/bin/python -m benchmarks.mqtt_instructions --messages 3000
    .venv/bin/python -m benchmarks.mqtt_instructions --messages 3000 --connections 100 --inflight 10

``keygate serve`` runs on SQLite in a process of its own under ``valgrind
--tool=callgrind`` (as ``benchmarks.native_instructions`` runs it); a queue of 16
partitions subscribes to the topic, and ``benchmarks.mqtt``'s raw client publishes
``--messages`` QoS 1 messages of 256 bytes from ``--connections`` connections at once,
each with up to ``--inflight`` unacknowledged, twice (the connections are made before
counting starts). Printed: the gateway's instructions
in the second round over ``--messages``, those of one message received, stored and
acknowledged (the first round pays for first use). Only user-space instructions are
counted: a change that trades system calls for instructions reads worse here than it
runs. A run takes a minute or two, most of it the gateway's start.
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path

from benchmarks.mqtt import RawClient, publish_from
from benchmarks.native_instructions import counted
from gateway.client import Client

PARTITIONS = 16
TOPIC = "bench/mqtt"
SIZE = 256
PHASES = ("publish-1", "publish-2")


async def phases(
    url: str,
    address: str,
    control: Callable[[str], None],
    *,
    messages: int,
    connections: int,
    inflight: int,
) -> None:
    """Declare the queue and connect the clients, then publish ``messages`` twice over
    MQTT at ``address``; ``control`` is called with ``--zero`` once connected and
    ``--dump=PHASE`` after each round (connecting is not counted)."""
    async with Client(url) as admin:
        queue = "bench-" + uuid.uuid4().hex[:8]
        await admin.declare_queue(queue, partitions=PARTITIONS, subscriptions=[TOPIC])
    clients = [await RawClient.connect(address, version=5) for _ in range(connections)]
    try:
        await asyncio.to_thread(control, "--zero")
        for phase in PHASES:
            refused = await publish_from(
                clients, messages, topic=TOPIC, size=SIZE, inflight=inflight
            )
            if refused:
                raise SystemExit(f"{refused} of {messages} publishes refused")
            await asyncio.to_thread(control, f"--dump={phase}")
    finally:
        for client in clients:
            client.close()


def instructions(
    messages: int, connections: int, inflight: int, keep: Path | None = None
) -> dict[str, int]:
    """Instructions the gateway spent in each round of ``messages``; ``keep``: a
    directory to copy the callgrind files to."""
    mqtt: dict[str, int] = {}
    return counted(
        lambda url, control: phases(
            url,
            f"127.0.0.1:{mqtt['port']}",
            control,
            messages=messages,
            connections=connections,
            inflight=inflight,
        ),
        PHASES,
        keep=keep,
        mqtt=mqtt,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--messages", type=int, default=3000, help="messages per round")
    parser.add_argument("--connections", type=int, default=1)
    parser.add_argument("--inflight", type=int, default=1000, help="per connection")
    parser.add_argument("--runs", type=int, default=1, help="runs (each printed)")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="keep the callgrind files")
    args = parser.parse_args()
    for _ in range(args.runs):
        counts = instructions(args.messages, args.connections, args.inflight, args.keep)
        print(
            f"MQTT 5 QoS 1, {SIZE}-byte messages, SQLite, {args.connections} connection(s) x "
            f"{args.inflight} in flight: {counts['publish-2'] / args.messages:,.0f} "
            f"instructions per message (the first {args.messages:,}: "
            f"{counts['publish-1'] / args.messages:,.0f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
