"""End to end over real sockets: the SDK against a real gateway, on SQLite and PostgreSQL.

Each test drives the partitioned-queue behaviour of DESIGN.md §4 the way a user sees it.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import Any

import pytest
import sqlalchemy as sa

from core.errors import Conflict, GroupLimitReached, QueueNotFound
from core.model import GroupConfig, KeyOrder, StartPosition
from gateway.client import Client, Consumer, ConsumerClosed, Message
from gateway.inspect import inspect_queue
from gateway.server import Gateway
from tests.integration.conftest import native_url, start_gateway
from tests.support.wait import eventually


async def _client(gateway: Gateway, name: str) -> Client:
    return await Client(native_url(gateway), client_name=name).connect()


async def _declare(gateway: Gateway, name: str = "orders", **settings: Any) -> None:
    async with Client(native_url(gateway)) as admin:
        await admin.declare_queue(name, **settings)


async def _publish(gateway: Gateway, queue: str, items: list[tuple[str, int]]) -> None:
    async with Client(native_url(gateway)) as producer:
        await asyncio.gather(
            *(producer.publish(queue, f"{key}:{n}".encode(), key=key) for key, n in items)
        )


def _parse(msg: Message) -> tuple[str, int]:
    key, n = msg.payload.decode().rsplit(":", 1)
    return key, int(n)


async def _states(gateway: Gateway, queue: str, group: str) -> dict[int, str]:
    assert gateway.broker is not None
    data = await inspect_queue(gateway.broker, gateway.store, queue)
    (entry,) = [g for g in data["groups"] if g["group"] == group]
    return {p["partition"]: p["state"] for p in entry["partitions"]}


async def test_per_key_order_holds_with_three_consumers(gateway: Gateway) -> None:
    await _declare(gateway, partitions=8)
    clients = [await _client(gateway, f"c{i}") for i in range(3)]
    consumers = [await c.subscribe("orders", group="billing", window=25) for c in clients]
    await eventually(lambda: all(c.partitions for c in consumers))
    items = [(f"key-{k}", n) for n in range(30) for k in range(20)]
    await _publish(gateway, "orders", items)
    seen: dict[str, list[int]] = defaultdict(list)

    async def drain(consumer: Consumer) -> None:
        while sum(map(len, seen.values())) < len(items):
            try:
                msg = await consumer.receive(timeout=0.2)
            except TimeoutError:
                continue
            key, n = _parse(msg)
            seen[key].append(n)
            assert msg.partition in consumer.partitions
            await consumer.acknowledge(msg)

    await asyncio.wait_for(asyncio.gather(*(drain(c) for c in consumers)), 30)
    assert all(seen[f"key-{k}"] == list(range(30)) for k in range(20))
    owned = [c.partitions for c in consumers]
    assert sorted(p for s in owned for p in s) == list(range(8))
    for client in clients:
        await client.close()


async def test_killed_consumer_partitions_are_unbound_then_reassigned_with_unacked_redelivered(
    gateway: Gateway,
) -> None:
    await _declare(gateway, partitions=4, rebalance_delay=1.0)
    a_client, b_client = await _client(gateway, "a"), await _client(gateway, "b")
    a = await a_client.subscribe("orders", group="g", window=50)
    b = await b_client.subscribe("orders", group="g", window=50)
    await eventually(lambda: len(a.partitions) == 2 and len(b.partitions) == 2)
    a_parts = a.partitions
    await _publish(gateway, "orders", [(f"k{i}", i) for i in range(40)])
    held = [await a.receive(timeout=5) for _ in range(5)]  # received, never acked
    a_client.abort()
    states = await eventually(lambda: _unbound(gateway, a_parts), timeout=5, interval=0.01)
    assert states
    await eventually(lambda: b.partitions == frozenset(range(4)), timeout=10)
    # Every message sent to a and not acked comes again, flagged: the five a's application
    # took, and whatever else a's SDK had buffered (how many depends on commit batching).
    held_ids = {m.message_id for m in held}
    redelivered: dict[str, Message] = {}
    while not held_ids <= redelivered.keys():
        msg = await b.receive(timeout=5)
        if msg.redelivered:
            redelivered[msg.message_id] = msg
        await b.acknowledge(msg)
    assert all(redelivered[i].delivery_count == 2 for i in held_ids)
    assert all(m.partition in a_parts for m in redelivered.values())
    await b_client.close()


async def _unbound(gateway: Gateway, partitions: frozenset[int]) -> bool:
    states = await _states(gateway, "orders", "g")
    return all(states[p] == "unbound" for p in partitions)


async def test_reconnect_within_rebalance_delay_keeps_partitions(gateway: Gateway) -> None:
    await _declare(gateway, partitions=4, rebalance_delay=5.0)
    a_client, b_client = await _client(gateway, "a"), await _client(gateway, "b")
    a = await a_client.subscribe("orders", group="g", window=10)
    b = await b_client.subscribe("orders", group="g", window=10)
    await eventually(lambda: len(a.partitions) == 2 and len(b.partitions) == 2)
    before_a, before_b = a.partitions, b.partitions
    (await a_client.session.connection()).abort()  # a network cut; the SDK reconnects
    await eventually(lambda: a_client.session.reconnects == 1, timeout=10)
    await eventually(lambda: _owned_by(gateway, before_a, "a"), timeout=5)
    assert a.partitions == before_a
    assert b.partitions == before_b
    await _publish(gateway, "orders", [(f"k{i}", i) for i in range(20)])
    got = [await a.receive(timeout=5) for _ in range(3)]
    assert all(m.partition in before_a for m in got)
    await a_client.close()
    await b_client.close()


async def _owned_by(gateway: Gateway, partitions: frozenset[int], client: str) -> bool:
    assert gateway.broker is not None
    data = await inspect_queue(gateway.broker, gateway.store, "orders")
    (entry,) = data["groups"]
    by_partition = {p["partition"]: p for p in entry["partitions"]}
    return all(
        by_partition[p]["state"] == "ready" and by_partition[p]["owner_client"] == client
        for p in partitions
    )


async def test_fresh_client_within_delay_is_treated_as_new(gateway: Gateway) -> None:
    await _declare(gateway, partitions=4, rebalance_delay=1.5)
    a_client, b_client = await _client(gateway, "a"), await _client(gateway, "b")
    a = await a_client.subscribe("orders", group="g", window=10)
    b = await b_client.subscribe("orders", group="g", window=10)
    await eventually(lambda: len(a.partitions) == 2 and len(b.partitions) == 2)
    a_parts = a.partitions
    a_client.abort()
    await eventually(lambda: _unbound(gateway, a_parts), timeout=5, interval=0.01)
    c_client = await _client(gateway, "a")  # same name, restarted: no previous set
    c = await c_client.subscribe("orders", group="g", window=10)
    # The restarted client does not get the reserved partitions back before expiry ...
    assert not (c.partitions & a_parts)
    # ... and after the delay a second rebalance includes it: 2 + 2.
    await eventually(lambda: len(c.partitions) == 2 and len(b.partitions) == 2, timeout=10)
    assert c.partitions | b.partitions == frozenset(range(4))
    await c_client.close()
    await b_client.close()


async def test_new_consumer_joining_gets_partitions_by_graceful_handoff(gateway: Gateway) -> None:
    await _declare(gateway, partitions=2, max_handoff_time=5.0)
    a_client, b_client = await _client(gateway, "a"), await _client(gateway, "b")
    a = await a_client.subscribe("orders", group="g", window=100)
    await eventually(lambda: a.partitions == frozenset({0, 1}))
    await _publish(gateway, "orders", [(f"k{i}", i) for i in range(20)])
    held = [await a.receive(timeout=5) for _ in range(20)]  # all in flight at A
    b = await b_client.subscribe("orders", group="g", window=100)
    await eventually(lambda: _paused(gateway), timeout=5)
    # While A holds unacked messages of the moving partition, B (whose only partition it
    # will be) receives nothing: never two owners delivering one partition.
    with pytest.raises(TimeoutError):
        await b.receive(timeout=0.5)
    for msg in held:
        await a.acknowledge(msg)
    await eventually(lambda: len(b.partitions) == 1 and len(a.partitions) == 1, timeout=10)
    await _publish(gateway, "orders", [(f"k{i}", i) for i in range(20, 40)])
    first = await b.receive(timeout=5)
    assert first.partition in b.partitions
    assert not first.redelivered  # A acked in time: nothing was delivered twice
    assert (first.partition, first.seq) not in {(m.partition, m.seq) for m in held}
    await a_client.close()
    await b_client.close()


async def _paused(gateway: Gateway) -> set[int]:
    states = await _states(gateway, "orders", "g")
    return {p for p, state in states.items() if state == "paused"}


async def test_standby_takes_over_when_an_active_flow_leaves(gateway: Gateway) -> None:
    await _declare(gateway, partitions=2)
    clients = [await _client(gateway, f"c{i}") for i in range(3)]
    consumers = [await c.subscribe("orders", group="g", window=10) for c in clients]
    await eventually(lambda: sum(len(c.partitions) for c in consumers) == 2)
    (standby,) = [c for c in consumers if not c.partitions]
    leaving = next(c for c in consumers if c.partitions)
    given_up = leaving.partitions
    await leaving.close(shutdown=True)
    await eventually(lambda: standby.partitions == given_up, timeout=5)
    for client in clients:
        await client.close()


async def test_nack_redelivers_after_the_backoff(gateway: Gateway) -> None:
    await _declare(gateway, partitions=1, backoff_initial=0.3)
    client = await _client(gateway, "c")
    consumer = await client.subscribe("orders", group="g", window=10)
    await _publish(gateway, "orders", [("k", 1)])
    first = await consumer.receive(timeout=5)
    nacked_at = time.monotonic()
    await consumer.negative_acknowledge(first)
    again = await consumer.receive(timeout=5)
    assert time.monotonic() - nacked_at >= 0.25
    assert again.message_id == first.message_id
    assert again.redelivered and again.delivery_count == 2
    await consumer.acknowledge(again)
    await client.close()


async def test_poison_message_is_dead_lettered_with_its_history(gateway: Gateway) -> None:
    await _declare(gateway, partitions=2, max_deliveries=2, backoff_initial=0.0)
    client = await _client(gateway, "c")
    consumer = await client.subscribe("orders", group="billing", window=10)
    await _publish(gateway, "orders", [("poison", 1)])
    for _ in range(2):
        await consumer.negative_acknowledge(await consumer.receive(timeout=5))
    dlq = await client.subscribe("orders.dlq", group="ops", window=10)
    letter = await dlq.receive(timeout=5)
    props = letter.properties
    assert letter.payload == b"poison:1"
    assert props["x-dead-letter-reason"] == "max-deliveries"
    assert props["x-original-queue"] == "orders"
    assert props["x-original-group"] == "billing"
    assert int(props["x-delivery-count"]) == 2
    assert "x-original-partition" in props and "x-original-seq" in props
    assert "x-first-delivery-time" in props
    with pytest.raises(TimeoutError):
        await consumer.receive(timeout=0.3)
    await client.close()


async def test_gateway_restart_loses_nothing_confirmed(db_url: str) -> None:
    first = await start_gateway(db_url)
    try:
        await _declare(first, partitions=4)
        await _publish(first, "orders", [(f"k{i % 7}", i) for i in range(200)])
        client = await _client(first, "c")
        consumer = await client.subscribe("orders", group="g", window=500)
        acked = set()
        for _ in range(50):
            msg = await consumer.receive(timeout=5)
            await consumer.acknowledge(msg)
            acked.add(_parse(msg)[1])
        await client.close()
    finally:
        await first.stop()
    second = await start_gateway(db_url)
    try:
        client = await _client(second, "c")
        consumer = await client.subscribe("orders", group="g", window=500)
        rest = set()
        while len(rest) < 150:
            msg = await consumer.receive(timeout=5)
            rest.add(_parse(msg)[1])
            await consumer.acknowledge(msg)
        assert not (acked & rest)  # a clean shutdown redelivers nothing acked
        assert acked | rest == set(range(200))
        await client.close()
    finally:
        await second.stop()


async def test_malformed_frames_get_an_error_and_the_server_stays_up(gateway: Gateway) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.ports["native"])
    writer.write(b"\x00\x00\x00\x05\xee\x00\x00\x00\x01")  # unknown frame type 0xEE
    data = await asyncio.wait_for(reader.read(), 5)  # an ERROR frame, then EOF
    assert b"protocol-error" in data
    writer.close()
    async with Client(native_url(gateway)) as client:
        with pytest.raises(QueueNotFound):
            await client.publish("no-such-queue", b"x")
        await client.declare_queue("orders", partitions=1)
        assert await client.publish("orders", b"still serving")


async def test_bound_flows_are_visible_in_sql_with_their_settings(
    gateway: Gateway, db_url: str
) -> None:
    await _declare(gateway, partitions=2)
    client = await _client(gateway, "billing-worker")
    await client.subscribe("orders", group="billing", window=7, ack_mode="auto")
    assert gateway.store is not None
    engine = gateway.store.engine

    async def flow_row() -> Any:
        async with engine.connect() as conn:
            result = await conn.execute(
                sa.text("SELECT client, group_name, window_size, ack_mode, state FROM kg_flows")
            )
            return result.first()

    row = await eventually(flow_row)
    assert tuple(row) == ("billing-worker", "billing", 7, "auto", "running")
    await client.close()


async def test_a_group_with_bound_consumers_cannot_be_deleted(gateway: Gateway) -> None:
    await _declare(gateway, partitions=2)
    assert gateway.broker is not None
    client = await _client(gateway, "c")
    consumer = await client.subscribe("orders", group="billing")
    with pytest.raises(Conflict, match="bound consumer"):
        await gateway.broker.delete_group("orders", "billing")
    await consumer.close()
    await gateway.broker.delete_group("orders", "billing")
    assert await gateway.store.list_groups("orders") == []  # type: ignore[union-attr]
    await client.close()


async def test_a_bind_takes_the_settings_it_leaves_out_and_may_not_contradict_the_rest(
    gateway: Gateway,
) -> None:
    """native-protocol.md, BIND: absent group settings take the group's values; present
    ones that contradict an existing group are a conflict (not silently the group's)."""
    await _declare(gateway, partitions=2)
    assert gateway.broker is not None
    await gateway.broker.create_group(
        GroupConfig(
            "orders",
            "billing",
            key_order=KeyOrder.STRICT,
            start=StartPosition.LATEST,
            tags={"color": "red"},
            ack_timeout=30.0,
        )
    )
    client = await _client(gateway, "c")
    plain = await client.subscribe("orders", group="billing")  # no settings named
    await plain.close()
    same = await client.subscribe(
        "orders", group="billing", key_order="strict", tags={"color": "red"}, ack_timeout=30.0
    )
    await same.close()
    for setting, contradicting in (
        ("key_order", "partition"),
        ("start", "earliest"),
        ("ack_timeout", 1.0),
        ("tags", {"color": "blue"}),
        ("mode", "shared"),
    ):
        with pytest.raises(Conflict, match="group 'billing' has"):
            await client.subscribe("orders", group="billing", **{setting: contradicting})
    await client.close()


async def test_a_window_of_zero_pauses_a_consumer_until_it_is_raised(gateway: Gateway) -> None:
    """native-protocol.md §5: CREDIT 0 pauses the flow; messages stored meanwhile wait in
    the group (loaded, none sent) and flow once the window is raised again."""
    await _declare(gateway, partitions=1)
    assert gateway.broker is not None
    client = await _client(gateway, "c")
    consumer = await client.subscribe("orders", group="g", window=10)
    await consumer.set_window(0)
    [runtime] = gateway.broker.runtimes("orders")
    await eventually(lambda: [f.window for f in runtime.status().flows] == [0])
    await _publish(gateway, "orders", [("k", n) for n in range(3)])
    # The step that loads the messages is the one that would send them.
    [part] = await eventually(
        lambda: [p for p in runtime.status().partitions if p.buffered == 3] or None
    )
    assert part.in_flight == 0 and consumer.window == 0
    # Paused across a network cut: bound again with a window of 1, paused at once.
    (await client.session.connection()).abort()
    await eventually(lambda: client.session.reconnects == 1)
    await eventually(lambda: [f.window for f in runtime.status().flows] == [0])
    assert consumer.window == 0
    assert sum(p.in_flight for p in runtime.status().partitions) <= 1
    await consumer.set_window(5)
    received = [await consumer.receive(timeout=10) for _ in range(3)]
    assert [m.payload for m in received] == [b"k:0", b"k:1", b"k:2"]
    await client.close()


async def test_consumers_cannot_create_more_groups_than_a_queue_may_have(db_url: str) -> None:
    """Each group a bind creates is permanent (and holds back retention): a consumer could
    create thousands. Binds stop creating them at max_groups_per_queue."""
    gateway = await start_gateway(db_url, max_groups_per_queue=2)
    try:
        assert gateway.broker is not None
        client = await _client(gateway, "c")
        await client.declare_queue("orders", partitions=1)
        for name in ("a", "b"):
            await (await client.subscribe("orders", group=name)).close()
        with pytest.raises(GroupLimitReached, match="max_groups_per_queue"):
            await client.subscribe("orders", group="c")
        await (await client.subscribe("orders", group="a")).close()  # existing: fine
        await gateway.broker.create_group(GroupConfig("orders", "ops"))  # an admin may
        assert sorted(g.name for g in await gateway.store.list_groups("orders")) == [  # type: ignore[union-attr]
            "a",
            "b",
            "ops",
        ]
        await client.close()
    finally:
        await gateway.stop()


async def test_deleting_a_queue_ends_only_its_consumers(gateway: Gateway) -> None:
    client = await _client(gateway, "c")
    await client.declare_queue("orders", partitions=1)
    await client.declare_queue("audit", partitions=1)
    doomed = await client.subscribe("orders", group="g")
    survivor = await client.subscribe("audit", group="g")
    assert gateway.broker is not None
    await gateway.broker.delete_queue_named("orders")
    with pytest.raises(ConsumerClosed) as ended:
        await doomed.receive(timeout=5)
    assert isinstance(ended.value.__cause__, QueueNotFound)
    await client.publish("audit", b"still here", key="k")
    assert (await survivor.receive(timeout=5)).payload == b"still here"
    assert client.session.reconnects == 0  # the connection itself went on
    await client.close()


async def test_a_consumer_already_on_the_dead_letter_queue_gets_letters_at_once(
    gateway: Gateway,
) -> None:
    await _declare(gateway, partitions=1, max_deliveries=1)
    client = await _client(gateway, "c")
    dlq = await client.subscribe("orders.dlq", group="ops")
    consumer = await client.subscribe("orders", group="billing")
    await _publish(gateway, "orders", [("k", 1)])
    await consumer.reject(await consumer.receive(timeout=5))
    letter = await dlq.receive(timeout=5)
    assert letter.payload == b"k:1"
    assert letter.properties["x-dead-letter-reason"] == "rejected"
    await client.close()
