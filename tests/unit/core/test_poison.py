"""The per-key poison policy (QueueConfig.on_dead_letter) in the group machine."""

from __future__ import annotations

import pytest

from core.actions import DeadLetterKey, GroupSnapshot, ParkedKey, PartitionSnapshot
from core.errors import InvalidArgument, KeyNotParked
from core.group import GroupMachine
from core.model import DeadLetterReason, GroupConfig, Message, QueueConfig
from tests.unit.core.driver import Driver

GROUP = GroupConfig("q", "g")


def make(*, snapshot: GroupSnapshot | None = None, **settings: object) -> Driver:
    return Driver(QueueConfig("q", **settings), GROUP, snapshot=snapshot)  # type: ignore[arg-type]


def _publish(d: Driver, key: str) -> Message:
    return d.publish(key, publish_time=d.now)


def _reject(d: Driver, flow: str, message: Message) -> None:
    d.unacked[flow].pop(message.message_id, None)
    d.call(d.machine.reject, flow, [message.message_id])


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="on_dead_letter"):
        QueueConfig("q", on_dead_letter="pause")


def test_continue_lets_the_key_flow_after_its_dead_letter() -> None:
    d = make()
    bad, nxt = _publish(d, "k"), _publish(d, "k")
    d.bind("a")
    _reject(d, "a", bad)
    assert [m.message_id for m in d.received("a")] == [bad.message_id, nxt.message_id]
    assert d.parked == {}


def test_park_key_holds_the_key_and_lets_other_keys_flow() -> None:
    d = make(on_dead_letter="park_key", max_deliveries=1)
    d.now = 5.0
    bad = _publish(d, "k")
    d.bind("a", window=1)
    later, other = _publish(d, "k"), _publish(d, "j")
    d.nack("a", bad)  # the last allowed delivery: dead-lettered, k parks
    assert [x.reason for x in d.dead] == [DeadLetterReason.MAX_DELIVERIES]
    assert d.parked == {(0, "k"): ParkedKey(0, "k", 5.0, bad.message_id, "max-deliveries")}
    assert d.machine.parked_keys() == [d.parked[0, "k"]]
    assert d.received("a") == [bad, other]
    d.ack("a", other)
    d.publish("j")
    assert later not in d.received("a")
    assert d.received("a")[-1].key == "j"


def test_a_released_key_resumes_in_order_from_its_oldest_held_message() -> None:
    d = make(on_dead_letter="park_key")
    bad = _publish(d, "k")
    d.bind("a", window=1)
    held = [_publish(d, "k"), _publish(d, "k")]
    _reject(d, "a", bad)
    assert d.received("a") == [bad]
    d.call(d.machine.release_key, "k")
    assert d.parked == {}
    d.ack("a", held[0])
    assert d.received("a") == [bad, *held]
    assert len(d.dead) == 1


def test_a_parked_key_holds_its_in_flight_messages_that_come_back() -> None:
    d = make(on_dead_letter="park_key", backoff_initial=0.0)
    bad, second = _publish(d, "k"), _publish(d, "k")
    d.bind("a")
    _reject(d, "a", bad)
    d.nack("a", second)  # in flight when k parked; back for retry: it waits too
    assert d.received("a") == [bad, second]
    d.call(d.machine.release_key, "k")
    assert d.received("a") == [bad, second, second]


def test_release_with_skip_dead_letters_the_held_messages_in_order() -> None:
    d = make(on_dead_letter="park_key")
    bad = _publish(d, "k")
    d.bind("a", window=1)
    held = [_publish(d, "k"), _publish(d, "k")]
    _reject(d, "a", bad)
    d.now = 1.0
    d.call(d.machine.release_key, "k", skip=True)
    assert [x.message for x in d.dead] == [bad, *held]
    assert [x.reason for x in d.dead[1:]] == [DeadLetterReason.KEY_DEAD_LETTERED] * 2
    d.now = 2.0
    fresh = _publish(d, "k")
    assert d.received("a") == [bad, fresh]


def test_releasing_a_key_that_is_not_parked_raises() -> None:
    d = make(on_dead_letter="park_key")
    with pytest.raises(KeyNotParked):
        d.machine.release_key(0.0, "k")


def test_an_expired_message_does_not_park_its_key() -> None:
    d = make(on_dead_letter="park_key", dead_letter_expired=True)
    d.publish("k", expire_at=1.0)
    d.advance(2.0)
    d.bind("a")
    assert [x.reason for x in d.dead] == [DeadLetterReason.EXPIRED]
    assert d.parked == {}


def test_parked_keys_survive_a_restart_through_the_snapshot() -> None:
    parked = ParkedKey(0, "k", 1.0, "m1", "rejected")
    d = make(on_dead_letter="park_key", snapshot=GroupSnapshot(parked=(parked,)))
    d.bind("a")
    m, other = _publish(d, "k"), _publish(d, "j")
    assert d.received("a") == [other]
    d.call(d.machine.release_key, "k")
    assert d.received("a") == [other, m]


def test_dead_letter_key_sends_the_rest_of_the_key_to_the_dlq_in_order() -> None:
    d = make(on_dead_letter="dead_letter_key")
    bad = _publish(d, "k")
    d.bind("a", window=1)
    rest = [_publish(d, "k"), _publish(d, "k")]
    other = _publish(d, "j")
    d.now = 1.0
    actions = d.call(d.machine.reject, "a", [bad.message_id])
    assert [x.message for x in d.dead] == [bad, *rest]
    assert [x.reason for x in d.dead] == [
        DeadLetterReason.REJECTED,
        DeadLetterReason.KEY_DEAD_LETTERED,
        DeadLetterReason.KEY_DEAD_LETTERED,
    ]
    # One action list: the owner writes them in one transaction.
    assert sum(type(a).__name__ == "DeadLetter" for a in actions) == 3
    assert d.received("a") == [bad, other]
    d.ack("a", other)
    d.now = 2.0
    fresh = _publish(d, "k")
    assert d.received("a") == [bad, other, fresh]


def test_dead_letter_key_also_takes_messages_not_read_yet() -> None:
    d = make(on_dead_letter="dead_letter_key")
    d.machine = GroupMachine(d.queue, GROUP, now=0.0, buffer_size=2)
    bad = _publish(d, "k")
    rest = [_publish(d, "k") for _ in range(4)]
    d.bind("a", window=1)
    d.now = 1.0
    d.unacked["a"].pop(bad.message_id)
    actions = d.call(d.machine.reject, "a", [bad.message_id])
    # Three were read, two only stored: one action list (one transaction) moves them all.
    kinds = [type(a).__name__ for a in actions if "DeadLetter" in type(a).__name__]
    assert kinds == ["DeadLetter"] * 3 + ["DeadLetterKey"]
    assert [x.message for x in d.dead] == [bad, *rest]
    assert d.settled(0, 5)
    d.now = 2.0
    fresh = _publish(d, "k")
    assert d.received("a") == [bad, fresh]


def test_a_key_being_moved_waits_for_the_report_of_what_storage_moved() -> None:
    d = make(on_dead_letter="dead_letter_key")
    d.machine = GroupMachine(d.queue, GROUP, now=0.0, buffer_size=2)
    bad, first, second = _publish(d, "k"), _publish(d, "j"), _publish(d, "j")
    rest, other = _publish(d, "k"), _publish(d, "j")
    d.bind("a", window=1)
    actions = d.machine.reject(d.now, "a", [bad.message_id])
    move = next(a for a in actions if isinstance(a, DeadLetterKey))
    assert (move.partition, move.key, move.after_seq) == (0, "k", second.seq)
    # The owner reads on before storage reports: rest (moved) and late (stored after the
    # move's transaction) are held meanwhile; other keys flow.
    d.run([a for a in actions if not isinstance(a, DeadLetterKey)])
    late = _publish(d, "k")
    d.ack("a", first)
    d.ack("a", second)
    d.ack("a", other)
    assert d.received("a") == [bad, first, second, other]
    d.run(d.machine.key_dead_lettered(d.now, 0, "k", [rest.seq]))
    assert d.settled(0, rest.seq)
    assert d.received("a") == [bad, first, second, other, late]
    assert [x.message for x in d.dead] == [bad]


def test_dead_letter_key_takes_an_in_flight_message_that_comes_back() -> None:
    d = make(on_dead_letter="dead_letter_key")
    bad, second = _publish(d, "k"), _publish(d, "k")
    d.bind("a")
    d.now = 1.0
    _reject(d, "a", bad)
    d.nack("a", second)
    assert [x.message for x in d.dead] == [bad, second]
    assert d.received("a") == [bad, second]


def test_recovery_does_not_dead_letter_a_parked_keys_held_messages() -> None:
    # dispatched_seq 2 makes recovery count seq 2 as possibly delivered once already.
    snapshot = GroupSnapshot(
        partitions={0: PartitionSnapshot(committed_seq=1, dispatched_seq=2)},
        parked=(ParkedKey(0, "k", 1.0, "m0", "rejected"),),
    )
    d = make(on_dead_letter="park_key", max_deliveries=1, snapshot=snapshot)
    d.store[0] = [Message("m0", "q", 0, 1, "k", b""), Message("m1", "q", 0, 2, "k", b"")]
    d.bind("a")
    assert d.dead == []
    d.call(d.machine.release_key, "k")
    assert [(x.message.message_id, x.delivery_count) for x in d.deliveries] == [("m1", 2)]
