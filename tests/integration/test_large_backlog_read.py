"""A group that has seen small messages reads a backlog of large ones within its budget.

A group sizes its reads by the messages it has seen (docs/operations.md, Limits,
``group_buffer_bytes``). With 1 KiB messages seen, a backlog of 4 MiB messages behind them
was read whole — 60 of them, 240 MiB, in one read for a 2 MiB budget (the gateway's peak
RSS 118 -> 360 MB). Storage now ends a page with the large message that takes it past what
the read reserved (core.actions.fetched). The gateway runs as a real ``keygate
serve`` so its peak memory can be read from /proc.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from gateway.client import Client
from tests.support.serve import serve

SMALL, LARGE = b"s" * 1000, b"L" * (4 << 20)
# What draining 60 large messages may add to the gateway's peak memory: a few copies of the
# one or two large messages on their way (the row, the DELIVER frame, the socket) and the
# allocator's slack; the whole backlog read at once added 240 MB.
BOUND = 120 << 20


def _peak(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    assert match is not None
    return int(match.group(1)) * 1024


async def test_a_backlog_of_large_messages_behind_small_ones_is_read_within_the_budget(
    db_url: str, tmp_path: Path
) -> None:
    with serve(db_url, tmp_path) as (proc, ports, _log):
        async with Client(f"keygate://127.0.0.1:{ports['native']}") as client:
            await client.declare_queue("q", partitions=1)
            consumer = await client.subscribe("q", group="g", window=2000)
            await asyncio.gather(*(client.publish("q", SMALL, key="k") for _ in range(3000)))
            # The window holds 2,000 small messages unacked, the group buffers the rest, and
            # the large ones are stored behind them, unread.
            held = [await consumer.receive(timeout=10) for _ in range(2000)]
            for _ in range(60):
                await client.publish("q", LARGE, key="k")
            before = _peak(proc.pid)
            for message in held:
                await consumer.acknowledge(message)
            sizes = []
            async with asyncio.timeout(60):
                while len(sizes) < 1060:
                    message = await consumer.receive()
                    sizes.append(len(message.payload))
                    await consumer.acknowledge(message)
            growth = _peak(proc.pid) - before
    assert sizes == [len(SMALL)] * 1000 + [len(LARGE)] * 60  # all of them, in order
    assert growth < BOUND, f"the gateway's peak memory grew by {growth >> 20} MiB"
