"""The consuming half of a STOMP connection: SUBSCRIBE/ACK/NACK resolved, MESSAGE built."""

from __future__ import annotations

import pytest

from core.model import Message
from protocols.stomp.errors import InvalidFrame
from protocols.stomp.frames import Frame, Version
from protocols.stomp.subscriptions import Subscriptions


def _frame(command: str, **headers: str) -> Frame:
    return Frame(command, tuple((k.replace("_", "-"), v) for k, v in headers.items()))


def _message(seq: int, partition: int = 0, key: str | None = "k") -> Message:
    return Message(
        message_id=f"m{partition}-{seq}",
        queue="orders",
        partition=partition,
        seq=seq,
        key=key,
        payload=b"hello",
        properties={"color": "red", "JMSXGroupID": "k", "big": 7, "raw": b"\xff"},
        content_type="text/plain",
    )


def _subscribed(ack: str, **headers: str) -> Subscriptions:
    subs = Subscriptions()
    subs.subscribe(_frame("SUBSCRIBE", id="s1", destination="/queue/orders", ack=ack, **headers))
    return subs


def test_subscribe_reads_queue_group_ack_mode_and_prefetch() -> None:
    subs = Subscriptions()
    event = subs.subscribe(
        Frame(
            "SUBSCRIBE",
            (
                ("id", "s1"),
                ("destination", "/queue/orders"),
                ("ack", "client-individual"),
                ("x-group", "billing"),
                ("activemq.prefetchSize", "25"),
                ("receipt", "r1"),
            ),
        )
    )
    assert (event.queue, event.group, event.ack, event.prefetch, event.receipt) == (
        "orders",
        "billing",
        "client-individual",
        25,
        "r1",
    )
    plain = subs.subscribe(_frame("SUBSCRIBE", id="s2", destination="/queue/orders"))
    assert (plain.group, plain.ack, plain.prefetch) == ("default", "auto", None)


@pytest.mark.parametrize(
    "headers",
    [
        {"destination": "/queue/orders"},  # no id
        {"id": "s1", "destination": "/topic/a.b"},
        {"id": "s1", "destination": "/queue/orders", "ack": "sometimes"},
        {"id": "s1", "destination": "/queue/orders", "prefetch_count": "0"},
        {"id": "s1", "destination": "/queue/orders", "prefetch_count": "9" * 400},
    ],
)
def test_a_bad_subscribe_is_a_protocol_error(headers: dict[str, str]) -> None:
    with pytest.raises(InvalidFrame):
        Subscriptions().subscribe(_frame("SUBSCRIBE", **headers))


def test_a_message_frame_carries_position_count_key_and_published_headers() -> None:
    subs = _subscribed("client-individual")
    frame = subs.message("s1", 1, _message(7, partition=3), delivery_count=2, redelivered=True)
    assert frame is not None
    headers = frame.header_map()
    assert frame.command == "MESSAGE" and frame.body == b"hello"
    assert headers["subscription"] == "s1" and headers["ack"] == "1:m3-7"
    assert (headers["x-partition"], headers["x-seq"], headers["x-delivery-count"]) == (
        "3",
        "7",
        "2",
    )
    assert headers["redelivered"] == "true" and headers["JMSXGroupID"] == "k"
    assert (headers["color"], headers["big"], headers["content-length"]) == ("red", "7", "5")
    assert [name for name, _ in frame.headers].count("JMSXGroupID") == 1


def test_auto_ack_messages_need_no_ack() -> None:
    subs = _subscribed("auto")
    frame = subs.message("s1", 1, _message(1), 1, False)
    assert frame is not None and frame.header("ack") is None
    with pytest.raises(InvalidFrame):
        subs.settle(_frame("ACK", id="1:m0-1"), Version.V1_2)


def test_client_individual_ack_settles_exactly_the_message_once() -> None:
    subs = _subscribed("client-individual")
    for seq in (1, 2):
        subs.message("s1", 1, _message(seq), 1, False)
    settle = subs.settle(_frame("ACK", id="1:m0-2", receipt="r"), Version.V1_2)
    assert (settle.message_ids, settle.ack, settle.receipt) == (("m0-2",), True, "r")
    with pytest.raises(InvalidFrame):
        subs.settle(_frame("ACK", id="1:m0-2"), Version.V1_2)
    assert subs.settle(_frame("NACK", id="1:m0-1"), Version.V1_2).ack is False


def test_client_ack_is_cumulative_within_the_partition_only() -> None:
    subs = _subscribed("client")
    for seq in (1, 2, 3):
        subs.message("s1", 1, _message(seq, partition=0), 1, False)
    subs.message("s1", 1, _message(1, partition=1), 1, False)
    settle = subs.settle(_frame("ACK", id="1:m0-2"), Version.V1_2)
    assert settle.message_ids == ("m0-1", "m0-2")
    with pytest.raises(InvalidFrame):
        subs.settle(_frame("ACK", id="1:m0-1"), Version.V1_2)  # covered by the cumulative ack
    assert subs.settle(_frame("ACK", id="1:m1-1"), Version.V1_2).message_ids == ("m1-1",)
    assert subs.settle(_frame("ACK", id="1:m0-3"), Version.V1_2).message_ids == ("m0-3",)


def test_a_cumulative_ack_covers_what_was_sent_before_not_lower_seqs_sent_later() -> None:
    subs = _subscribed("client")
    for seq in (1, 2, 3):
        subs.message("s1", 1, _message(seq), 1, False)
    subs.settle(_frame("NACK", id="1:m0-1"), Version.V1_2)
    subs.message("s1", 1, _message(1), 2, True)  # the redelivery comes after m0-3
    assert subs.settle(_frame("ACK", id="1:m0-3"), Version.V1_2).message_ids == ("m0-2", "m0-3")
    assert subs.settle(_frame("NACK", id="1:m0-1"), Version.V1_2).message_ids == ("m0-1",)


def test_two_subscriptions_holding_one_message_have_their_own_ack_ids() -> None:
    subs = _subscribed("client-individual")
    subs.subscribe(_frame("SUBSCRIBE", id="s2", destination="/queue/orders", ack="client"))
    first = subs.message("s1", 1, _message(1), 1, False)
    second = subs.message("s2", 2, _message(1), 1, False)
    assert first is not None and second is not None
    assert (first.header("ack"), second.header("ack")) == ("1:m0-1", "2:m0-1")
    assert subs.settle(_frame("ACK", id="2:m0-1"), Version.V1_2).subscription == "s2"
    assert subs.settle(_frame("ACK", id="1:m0-1"), Version.V1_2).subscription == "s1"
    with pytest.raises(InvalidFrame):
        subs.settle(_frame("ACK", id="m0-1"), Version.V1_2)  # a message id is not an ack id


def test_stomp_1_1_and_1_0_acks_name_the_message_id() -> None:
    subs = _subscribed("client-individual")
    subs.message("s1", 1, _message(1), 1, False)
    subs.message("s1", 1, _message(2), 1, False)
    acked = subs.settle(_frame("ACK", message_id="m0-1", subscription="s1"), Version.V1_1)
    assert acked.message_ids == ("m0-1",)
    assert subs.settle(_frame("ACK", message_id="m0-2"), Version.V1_0).message_ids == ("m0-2",)
    with pytest.raises(InvalidFrame):
        subs.settle(_frame("ACK", message_id="m0-1", subscription="other"), Version.V1_1)


def test_a_delivery_to_a_removed_or_replaced_subscription_makes_no_frame() -> None:
    subs = _subscribed("client-individual")
    subs.unsubscribe(_frame("UNSUBSCRIBE", id="s1"))
    assert subs.message("s1", 1, _message(1), 1, False) is None
    again = subs.subscribe(_frame("SUBSCRIBE", id="s1", destination="/queue/orders", ack="client"))
    assert again.serial != 1
    assert subs.message("s1", 1, _message(2), 1, False) is None  # the old subscription's
    assert subs.message("s1", again.serial, _message(3), 1, False) is not None


def test_unsubscribe_forgets_the_subscription_and_its_unacked_messages() -> None:
    subs = _subscribed("client")
    subs.message("s1", 1, _message(1), 1, False)
    assert subs.unsubscribe(_frame("UNSUBSCRIBE", id="s1")).subscription == "s1"
    assert len(subs) == 0
    with pytest.raises(InvalidFrame):
        subs.settle(_frame("ACK", id="1:m0-1"), Version.V1_2)
    with pytest.raises(InvalidFrame):
        subs.unsubscribe(_frame("UNSUBSCRIBE", id="s1"))
