"""The asyncio SDK against a scripted fake gateway speaking the real codec."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable

import pytest

from core.errors import AuthenticationFailed, InvalidArgument, KeygateError, QueueNotFound
from core.model import AckMode
from gateway.client import Backoff, Client, ClientClosed, ConnectionLost, Consumer, ConsumerClosed
from protocols.native import (
    Ack,
    AckCumulative,
    Bind,
    Close,
    Credit,
    DeclareQueue,
    Hello,
    Nack,
    NackOutcome,
    Publish,
    PublishOk,
    Unbind,
)
from tests.unit.client.fake_gateway import FakeGateway

FAST = Backoff(initial=0.01, maximum=0.05)


@pytest.fixture
async def gateway() -> AsyncIterator[FakeGateway]:
    fake = FakeGateway()
    fake.queues["orders"] = 2
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture
async def client(gateway: FakeGateway) -> AsyncIterator[Client]:
    async with Client(gateway.url, client_name="test", backoff=FAST, heartbeat=0) as c:
        yield c


async def subscribed(
    client: Client, gateway: FakeGateway, **options: object
) -> tuple[Consumer, str]:
    consumer = await client.subscribe("orders", "billing", window=10, **options)  # type: ignore[arg-type]
    assert consumer.flow_id is not None
    return consumer, consumer.flow_id


async def test_publish_returns_the_message_id_confirmed_by_the_gateway(client: Client) -> None:
    assert await client.publish("orders", b"hello", key="c-1", properties={"a": "b"}) == "id-1"


async def test_publishes_are_pipelined_and_each_gets_its_own_confirmation(
    client: Client, gateway: FakeGateway
) -> None:
    gateway.hold_publishes = True
    tasks = [asyncio.create_task(client.publish("orders", str(i).encode())) for i in range(50)]
    await gateway.wait_for(lambda: len(gateway.of_type(Publish)) == 50)
    assert not any(t.done() for t in tasks)
    session = gateway.sessions[0]
    for event in reversed(gateway.of_type(Publish)):
        session.send(
            PublishOk(request_id=event.request_id, message_ids=(f"m-{event.payload.decode()}",))
        )
    assert await asyncio.gather(*tasks) == [f"m-{i}" for i in range(50)]


async def test_an_error_frame_raises_the_matching_keygate_error_and_the_connection_survives(
    client: Client,
) -> None:
    with pytest.raises(QueueNotFound, match="no missing"):
        await client.publish("missing", b"x")
    assert await client.publish("orders", b"x")


async def test_declare_queue_sends_settings_and_returns_the_stored_queue(
    client: Client, gateway: FakeGateway
) -> None:
    config = await client.declare_queue(
        "payments", partitions=8, subscriptions=["orders/#"], rebalance_delay=2.5, ttl=None
    )
    assert (config.name, config.partitions, config.subscriptions) == ("payments", 8, ("orders/#",))
    assert config.rebalance_delay == 2.5
    [declare] = gateway.of_type(DeclareQueue)
    assert isinstance(declare, DeclareQueue)
    assert dict(declare.settings) == {"partitions": 8, "rebalance_delay": 2.5}
    await client.delete_queue("payments")
    with pytest.raises(QueueNotFound):
        await client.delete_queue("payments")


async def test_an_unknown_queue_setting_is_refused_before_sending(client: Client) -> None:
    with pytest.raises(InvalidArgument, match="colour"):
        await client.declare_queue("q", colour="blue")


async def test_subscribe_receive_and_batched_acknowledge(
    client: Client, gateway: FakeGateway
) -> None:
    consumer, flow = await subscribed(client, gateway, tags={"region": "eu"}, mode="partitioned")
    [bind] = gateway.of_type(Bind)
    assert isinstance(bind, Bind)
    assert (bind.window, bind.tags, bind.previous_partitions) == (10, {"region": "eu"}, None)
    assert consumer.partitions == {0, 1}
    for seq in range(1, 4):
        gateway.deliver(flow, seq, properties={"n": seq}, redelivered=seq == 3, delivery_count=2)
    messages = [await consumer.receive(timeout=5) for _ in range(3)]
    assert [(m.seq, m.properties, m.redelivered) for m in messages] == [
        (1, {"n": 1}, False),
        (2, {"n": 2}, False),
        (3, {"n": 3}, True),
    ]
    for message in messages:
        await consumer.acknowledge(message)
    await gateway.wait_for(lambda: bool(gateway.of_type(Ack)))
    assert gateway.of_type(Ack) == [
        Ack(flow_id=flow, message_ids=tuple(m.message_id for m in messages))
    ]


async def test_a_full_ack_batch_is_sent_at_once(gateway: FakeGateway) -> None:
    async with Client(gateway.url, heartbeat=0, ack_batch_size=2, ack_flush_interval=60) as client:
        consumer, flow = await subscribed(client, gateway)
        for seq in range(1, 4):
            gateway.deliver(flow, seq)
        for _ in range(3):
            await consumer.acknowledge(await consumer.receive(timeout=5))
        await gateway.wait_for(lambda: len(gateway.of_type(Ack)) == 1)
        await consumer.close()
    assert [len(a.message_ids) for a in gateway.of_type(Ack)] == [2, 1]


async def test_nack_reject_and_cumulative_ack_flush_pending_acks_first(
    client: Client, gateway: FakeGateway
) -> None:
    consumer, flow = await subscribed(client, gateway)
    for seq in range(1, 5):
        gateway.deliver(flow, seq)
    m1, m2, m3, m4 = [await consumer.receive(timeout=5) for _ in range(4)]
    await consumer.acknowledge(m1)
    await consumer.negative_acknowledge(m2, delay=1.5)
    await consumer.reject(m3)
    await consumer.acknowledge_cumulative(m4)
    await gateway.wait_for(lambda: bool(gateway.of_type(AckCumulative)))
    settles = [e for e in gateway.received if isinstance(e, Ack | Nack | AckCumulative)]
    assert settles == [
        Ack(flow_id=flow, message_ids=(m1.message_id,)),
        Nack(flow_id=flow, message_ids=(m2.message_id,), outcome=NackOutcome.RETRY, delay=1.5),
        Nack(flow_id=flow, message_ids=(m3.message_id,), outcome=NackOutcome.REJECT),
        AckCumulative(flow_id=flow, partition=m4.partition, seq=4),
    ]


async def test_auto_ack_consumers_send_no_acks(client: Client, gateway: FakeGateway) -> None:
    consumer, flow = await subscribed(client, gateway, ack_mode=AckMode.AUTO)
    gateway.deliver(flow, 1)
    await consumer.acknowledge(await consumer.receive(timeout=5))
    await consumer.close()
    assert gateway.of_type(Ack) == []


async def test_receive_times_out(client: Client, gateway: FakeGateway) -> None:
    consumer, _ = await subscribed(client, gateway)
    with pytest.raises(TimeoutError):
        await consumer.receive(timeout=0.01)


async def test_batch_receive_returns_what_arrived_within_the_timeout(
    client: Client, gateway: FakeGateway
) -> None:
    consumer, flow = await subscribed(client, gateway)
    assert await consumer.batch_receive(10, timeout=0.01) == []
    for seq in range(1, 4):
        gateway.deliver(flow, seq)
    batch = await consumer.batch_receive(3, timeout=5)
    assert [m.seq for m in batch] == [1, 2, 3]


async def test_pushed_partition_changes_reach_property_iterator_and_callback(
    client: Client, gateway: FakeGateway
) -> None:
    seen: list[frozenset[int]] = []
    consumer, flow = await subscribed(client, gateway, on_partitions_changed=seen.append)
    changes = consumer.partition_changes()
    gateway.change_partitions(flow, frozenset({1}))
    assert await asyncio.wait_for(anext(changes), 5) == {1}
    assert consumer.partitions == {1}
    assert seen == [{0, 1}, {1}]
    await consumer.close()
    with pytest.raises(StopAsyncIteration):
        await anext(changes)


async def test_close_flushes_acks_then_unbinds_and_ends_receivers(
    client: Client, gateway: FakeGateway
) -> None:
    consumer, flow = await subscribed(client, gateway)
    gateway.deliver(flow, 1)
    message = await consumer.receive(timeout=5)
    await consumer.acknowledge(message)
    waiter = asyncio.create_task(consumer.receive())
    await consumer.close(shutdown=True)
    tail = [e for e in gateway.received if isinstance(e, Ack | Unbind)]
    assert tail == [
        Ack(flow_id=flow, message_ids=(message.message_id,)),
        Unbind(request_id=tail[1].request_id, flow_id=flow, shutdown=True),
    ]
    with pytest.raises(ConsumerClosed):
        await waiter
    assert [m async for m in consumer] == []


async def test_set_window_sends_credit(client: Client, gateway: FakeGateway) -> None:
    consumer, flow = await subscribed(client, gateway)
    await consumer.set_window(3)
    await gateway.wait_for(lambda: bool(gateway.of_type(Credit)))
    assert gateway.of_type(Credit) == [Credit(flow_id=flow, window=3)]


async def test_wrong_password_fails_the_connect(gateway: FakeGateway) -> None:
    gateway.password = "secret"
    with pytest.raises(AuthenticationFailed):
        await Client(gateway.url, password="nope", heartbeat=0).connect()


async def test_reconnect_within_rebalance_delay_rebinds_with_the_partitions_it_held(
    client: Client, gateway: FakeGateway
) -> None:
    consumer, flow = await subscribed(client, gateway)
    gateway.change_partitions(flow, frozenset({1}))
    await gateway.wait_for(lambda: True)
    gateway.deliver(flow, 1)
    old = await consumer.receive(timeout=5)
    gateway.deliver(flow, 2)  # buffered, dropped at the cut: the gateway redelivers it
    await _until(lambda: len(consumer._buffer) == 1)
    gateway.drop_connections()
    await gateway.wait_for(lambda: len(gateway.of_type(Bind)) == 2)
    rebind = gateway.of_type(Bind)[1]
    assert isinstance(rebind, Bind)
    assert rebind.previous_partitions == frozenset({1})
    assert (rebind.queue, rebind.group, rebind.window) == ("orders", "billing", 10)
    await _until(lambda: consumer.flow_id not in (None, flow))
    assert consumer.partitions == {1}
    assert client.session.reconnects == 1
    await consumer.acknowledge(old)  # delivered before the cut: a no-op
    new_flow = consumer.flow_id
    assert new_flow is not None
    gateway.deliver(new_flow, 2, redelivered=True)
    again = await consumer.receive(timeout=5)
    assert (again.seq, again.redelivered) == (2, True)
    await consumer.acknowledge(again)
    await gateway.wait_for(lambda: bool(gateway.of_type(Ack)))
    assert gateway.of_type(Ack) == [Ack(flow_id=new_flow, message_ids=(again.message_id,))]


async def test_an_in_flight_publish_fails_at_a_cut_and_later_ones_use_the_new_connection(
    client: Client, gateway: FakeGateway
) -> None:
    gateway.hold_publishes = True
    pending = asyncio.create_task(client.publish("orders", b"x"))
    await gateway.wait_for(lambda: bool(gateway.of_type(Publish)))
    gateway.drop_connections()
    with pytest.raises(ConnectionLost):
        await pending
    gateway.hold_publishes = False
    assert await client.publish("orders", b"y")
    assert len(gateway.sessions) == 1


async def test_a_publish_with_a_dedup_id_is_resent_after_a_cut(
    client: Client, gateway: FakeGateway
) -> None:
    gateway.hold_publishes = True
    pending = asyncio.create_task(client.publish("orders", b"x", dedup_id="d-1"))
    await gateway.wait_for(lambda: bool(gateway.of_type(Publish)))
    gateway.hold_publishes = False
    gateway.drop_connections()
    assert await asyncio.wait_for(pending, 5)
    assert [p.dedup_id for p in gateway.of_type(Publish)] == [
        "d-1",
        "d-1",
    ]


async def test_an_unnamed_client_sends_one_generated_name_in_every_hello(
    gateway: FakeGateway,
) -> None:
    async with Client(gateway.url, backoff=FAST, heartbeat=0) as client:
        await subscribed(client, gateway)
        gateway.drop_connections()
        await gateway.wait_for(lambda: len(gateway.of_type(Bind)) == 2)
        async with Client(gateway.url, backoff=FAST, heartbeat=0) as restarted:
            names = [hello.client_name for hello in gateway.of_type(Hello)]
    assert names[0].startswith("keygate-py-")
    assert names == [client.client_name, client.client_name, restarted.client_name]
    assert restarted.client_name != client.client_name


async def test_a_connection_level_error_makes_the_client_reconnect_and_rebind(
    client: Client, gateway: FakeGateway
) -> None:
    consumer, _ = await subscribed(client, gateway)
    gateway.fail_connections("unavailable")
    await gateway.wait_for(lambda: len(gateway.of_type(Bind)) == 2)
    assert gateway.of_type(Bind)[1].previous_partitions == frozenset({0, 1})
    assert await client.publish("orders", b"after")
    assert consumer.partitions == {0, 1}


async def test_a_silent_gateway_is_detected_by_the_heartbeat(gateway: FakeGateway) -> None:
    gateway.answer_pings = False
    async with Client(gateway.url, heartbeat=0.05, backoff=FAST) as client:
        await gateway.wait_for(lambda: len(gateway.sessions) >= 2 or client.session.reconnects > 0)
        gateway.answer_pings = True
        await _until(lambda: client.session.reconnects >= 1)


async def test_a_gateway_that_sends_anything_is_alive_though_its_pongs_are_late(
    gateway: FakeGateway,
) -> None:
    # A busy link's PONGs may wait behind deliveries: what is read counts as a sign of life.
    gateway.answer_pings = False
    heartbeat = 0.1
    async with Client(gateway.url, heartbeat=heartbeat, backoff=FAST) as client:
        consumer, flow_id = await subscribed(client, gateway)
        for seq in range(1, 11):  # 5 heartbeats' time, every one without a PONG
            gateway.deliver(flow_id, seq)
            assert (await consumer.receive(timeout=5)).seq == seq
            await asyncio.sleep(heartbeat / 2)
        assert client.session.reconnects == 0 and len(gateway.sessions) == 1


async def test_a_gateway_that_accepts_but_never_answers_hello_is_given_up_as_a_silent_one() -> None:
    # A frozen gateway's kernel still accepts connections; connect_timeout alone (10 s by
    # default) would hold a reconnect there while the standby takes over.
    accepted: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda _, writer: accepted.append(writer), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        client = Client(f"keygate://127.0.0.1:{port}", heartbeat=0.1, connect_timeout=60)
        async with asyncio.timeout(5):  # three heartbeats: 0.3 s
            with pytest.raises(TimeoutError):
                await client.connect()
        assert len(accepted) == 1
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_giving_up_reconnecting_fails_consumers_and_calls(gateway: FakeGateway) -> None:
    client = Client(gateway.url, heartbeat=0, backoff=FAST, max_reconnect_attempts=2)
    await client.connect()
    consumer, _ = await subscribed(client, gateway)
    await gateway.stop()
    with pytest.raises(ConsumerClosed):
        await consumer.receive(timeout=5)
    with pytest.raises(ClientClosed):
        await client.publish("orders", b"x")
    await client.close()
    await gateway.start()


async def test_close_waits_for_the_confirm_of_a_publish_in_flight(gateway: FakeGateway) -> None:
    gateway.hold_publishes = gateway.hold_close = True
    client = await Client(gateway.url, heartbeat=0, backoff=FAST).connect()
    pending = asyncio.create_task(client.publish("orders", b"x"))
    await gateway.wait_for(lambda: bool(gateway.of_type(Publish)))
    closing = asyncio.create_task(client.close())
    await gateway.wait_for(lambda: bool(gateway.of_type(Close)))
    assert not pending.done() and not closing.done()
    (publish,) = gateway.of_type(Publish)
    gateway.sessions[0].send(PublishOk(request_id=publish.request_id, message_ids=("m-1",)))
    gateway.release_close()
    assert await asyncio.wait_for(pending, 5) == "m-1"
    await asyncio.wait_for(closing, 5)


async def test_close_fails_a_publish_still_unconfirmed_after_close_timeout(
    gateway: FakeGateway,
) -> None:
    gateway.hold_publishes = gateway.hold_close = True
    client = await Client(gateway.url, heartbeat=0, backoff=FAST, close_timeout=0.1).connect()
    pending = asyncio.create_task(client.publish("orders", b"x"))
    await gateway.wait_for(lambda: bool(gateway.of_type(Publish)))
    await asyncio.wait_for(client.close(), 5)
    with pytest.raises(ConnectionLost):
        await pending
    gateway.release_close()


async def test_a_publish_after_close_began_is_refused_at_once(gateway: FakeGateway) -> None:
    gateway.hold_close = True
    client = await Client(gateway.url, heartbeat=0, backoff=FAST).connect()
    closing = asyncio.create_task(client.close())
    await gateway.wait_for(lambda: bool(gateway.of_type(Close)))
    with pytest.raises(ClientClosed, match="close\\(\\) was called"):
        await client.publish("orders", b"late", dedup_id="d-1")
    assert not gateway.of_type(Publish)
    gateway.release_close()
    await asyncio.wait_for(closing, 5)


def test_backoff_is_exponential_capped_and_jittered_downwards() -> None:
    backoff = Backoff(initial=0.1, maximum=1.0, multiplier=2.0, jitter=0.5)
    rng = random.Random(7)
    delays = [backoff.delay(attempt, rng) for attempt in range(10)]
    for attempt, delay in enumerate(delays):
        base = min(1.0, 0.1 * 2**attempt)
        assert base * 0.5 <= delay <= base
    assert len(set(delays[5:])) == 5  # jitter spreads the capped delays
    assert Backoff(jitter=0).delay(1000, rng) == 10.0


def test_error_codes_map_to_classes_and_unknown_codes_stay_readable() -> None:
    from gateway.client import error_from_code

    assert type(error_from_code("queue-full", "full")).__name__ == "QueueFull"
    unknown = error_from_code("brand-new", "text")
    assert type(unknown) is KeygateError
    assert "brand-new" in str(unknown)


async def _until(predicate: Callable[[], bool], within: float = 5.0) -> None:
    """Poll client-side state with a deadline (it changes without an event to wait on)."""
    async with asyncio.timeout(within):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.001)
