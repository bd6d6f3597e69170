"""GroupMachine behaviour, one example per rule of DESIGN.md §4."""

from __future__ import annotations

import pytest

from core.actions import (
    DeadLetter,
    Deliver,
    DeliveryRecord,
    Dropped,
    Fetch,
    GroupSnapshot,
    OffsetUpdate,
    Page,
    PartitionsChanged,
    PartitionSnapshot,
    SeqRanges,
)
from core.errors import Conflict, InvalidArgument
from core.group import GroupMachine
from core.model import (
    AckMode,
    DeadLetterReason,
    GroupConfig,
    GroupMode,
    KeyOrder,
    Message,
    PartitionState,
    QueueConfig,
)
from core.partition import MESSAGE_OVERHEAD
from tests.unit.core.driver import Driver


def acked(update: OffsetUpdate) -> tuple[int, SeqRanges]:
    return update.committed_seq, update.acked_above


def make(
    partitions: int = 0,
    mode: GroupMode = GroupMode.PARTITIONED,
    key_order: KeyOrder = KeyOrder.PARTITION,
    **queue_settings: object,
) -> Driver:
    queue = QueueConfig("q", partitions=partitions, **queue_settings)  # type: ignore[arg-type]
    return Driver(queue, GroupConfig("q", "g", mode=mode, key_order=key_order))


def make_group(group: GroupConfig, **queue_settings: object) -> Driver:
    return Driver(QueueConfig("q", **queue_settings), group)  # type: ignore[arg-type]


# -- delivery and settle -------------------------------------------------------------------


def test_messages_of_a_partition_are_delivered_in_seq_order_within_the_window() -> None:
    d = make()
    ms = [d.publish(f"k{i}") for i in range(5)]
    d.bind("a", window=3)
    assert d.seqs("a") == [1, 2, 3]
    d.ack("a", ms[0])
    assert d.seqs("a") == [1, 2, 3, 4]
    assert acked(d.offsets[0]) == (1, ())


def test_out_of_order_acks_are_ranges_above_the_committed_seq() -> None:
    d = make()
    ms = [d.publish("k") for _ in range(4)]
    d.bind("a")
    d.ack("a", ms[1], ms[3])
    assert acked(d.offsets[0]) == (0, ((2, 2), (4, 4)))
    d.ack("a", ms[0])
    assert acked(d.offsets[0]) == (2, ((4, 4),))


def test_acks_of_unknown_or_settled_ids_are_ignored() -> None:
    d = make()
    m = d.publish("k")
    d.bind("a")
    d.ack("a", m)
    assert d.call(d.machine.ack, "a", [m.message_id, "nope"]) == []


def test_record_dispatch_precedes_every_first_delivery() -> None:
    d = make()
    d.bind("a")
    actions = d.call(d.machine.append, [Message("m", "q", 0, 1, "k", b"")])
    kinds = [type(a).__name__ for a in actions if type(a).__name__ in ("RecordDispatch", "Deliver")]
    assert kinds == ["RecordDispatch", "Deliver"]


def test_nack_redelivers_after_the_backoff_with_an_incremented_count() -> None:
    d = make()
    m = d.publish("k")
    d.bind("a")
    d.nack("a", m)
    assert d.machine.next_deadline() == 1.0
    d.advance(0.5)
    assert len(d.deliveries) == 1
    d.advance(0.5)
    assert [(x.delivery_count, x.redelivered) for x in d.deliveries] == [(1, False), (2, True)]


def test_nack_with_a_requested_delay_uses_it() -> None:
    d = make()
    m = d.publish("k")
    d.bind("a")
    d.nack("a", m, delay=0.0)
    assert [x.delivery_count for x in d.deliveries] == [1, 2]


def test_reject_dead_letters_now_and_settles() -> None:
    d = make()
    m = d.publish("k")
    d.bind("a")
    actions = d.call(d.machine.reject, "a", [m.message_id])
    letter, update = actions
    assert letter == DeadLetter(m, DeadLetterReason.REJECTED, 1, 0.0)
    assert isinstance(update, OffsetUpdate) and acked(update) == (1, ())


def test_the_failure_ending_the_last_allowed_delivery_dead_letters() -> None:
    d = make(max_deliveries=2, backoff_initial=0.0)
    m = d.publish("k")
    d.bind("a")
    d.nack("a", m)
    d.nack("a", m)
    assert [x.delivery_count for x in d.deliveries] == [1, 2]
    assert [(x.reason, x.delivery_count) for x in d.dead] == [(DeadLetterReason.MAX_DELIVERIES, 2)]
    assert d.settled(0, 1)


def test_queue_without_dlq_still_emits_dead_letter_for_the_owner_to_drop() -> None:
    d = make(dead_letter_queue="")
    m = d.publish("k")
    d.bind("a")
    d.call(d.machine.reject, "a", [m.message_id])
    assert len(d.dead) == 1


def test_ack_timeout_redelivers_unacked_messages() -> None:
    d = make_group(GroupConfig("q", "g", ack_timeout=10.0), backoff_initial=0.0)
    d.publish("k")
    d.bind("a")
    d.advance(10.0)
    assert [x.delivery_count for x in d.deliveries] == [1, 2]


def test_ack_cumulative_settles_everything_delivered_up_to_seq() -> None:
    d = make()
    [d.publish("k") for _ in range(4)]
    d.bind("a")
    d.call(d.machine.ack_cumulative, "a", 0, 3)
    assert acked(d.offsets[0]) == (3, ())


def test_ack_cumulative_is_refused_in_shared_mode() -> None:
    d = make(mode=GroupMode.SHARED)
    with pytest.raises(InvalidArgument):
        d.machine.ack_cumulative(0.0, "a", 0, 1)


def test_auto_ack_flows_are_bounded_by_their_window_until_the_owner_acks_the_write() -> None:
    d = make()
    messages = [d.publish("k") for _ in range(3)]
    d.bind("a", window=1, ack_mode=AckMode.AUTO)
    assert d.seqs("a") == [1]
    d.ack("a", messages[0])
    d.ack("a", messages[1])
    assert d.seqs("a") == [1, 2, 3]
    d.ack("a", messages[2])
    d.advance(1.0)
    assert acked(d.offsets[0]) == (3, ())


def test_an_auto_ack_flow_that_dies_before_the_write_leaves_its_messages_for_the_next() -> None:
    d = make()
    d.publish("k")
    d.bind("a", ack_mode=AckMode.AUTO)
    d.call(d.machine.unbind, "a", shutdown=True)
    d.bind("b", ack_mode=AckMode.AUTO)
    assert d.seqs("b") == [1]


def test_credit_changes_the_window() -> None:
    d = make()
    [d.publish("k") for _ in range(3)]
    d.bind("a", window=1)
    d.call(d.machine.credit, "a", 3)
    assert d.seqs("a") == [1, 2, 3]
    assert d.flows["a"].window == 3


def test_a_flow_whose_connection_is_behind_is_sent_nothing_until_it_catches_up() -> None:
    d = make()
    d.publish("k")
    d.bind("a", window=10)
    assert d.seqs("a") == [1]
    d.call(d.machine.backpressure, "a", True)
    [d.publish("k") for _ in range(2)]
    assert d.seqs("a") == [1]  # its window has room: the socket does not
    (flow,) = d.machine.status().flows
    assert flow.behind and flow.window == 10
    d.call(d.machine.backpressure, "a", False)
    assert d.seqs("a") == [1, 2, 3]
    assert not d.machine.status().flows[0].behind


def test_in_shared_mode_a_flow_that_is_behind_leaves_the_messages_to_the_others() -> None:
    d = make(mode=GroupMode.SHARED)
    d.bind("a", window=10)
    d.bind("b", window=10)
    d.call(d.machine.backpressure, "a", True)
    [d.publish(f"k{i}") for i in range(4)]
    assert d.seqs("a") == []
    assert len(d.seqs("b")) == 4


def test_backpressure_of_an_unknown_flow_is_ignored() -> None:
    d = make()
    d.bind("a")
    assert d.call(d.machine.backpressure, "nope", True) == []


def test_binding_a_flow_id_twice_is_a_conflict() -> None:
    d = make()
    d.bind("a")
    with pytest.raises(Conflict):
        d.bind("a")


# -- per-key order -------------------------------------------------------------------------


def test_a_retried_message_is_not_overtaken_by_a_later_message_of_its_key() -> None:
    d = make()
    k1 = d.publish("K")
    d.bind("a", window=1)
    k2 = d.publish("K")
    other = d.publish("other")
    d.nack("a", k1)  # retry due in 1 s; window is free again
    assert d.seqs("a") == [1, other.seq]
    d.ack("a", other)
    d.advance(1.0)
    assert d.seqs("a") == [1, 3, 1]
    d.ack("a", k1)
    assert d.seqs("a") == [1, 3, 1, k2.seq]


def test_strict_key_order_allows_one_unacked_message_per_key() -> None:
    d = make(key_order=KeyOrder.STRICT)
    a1, a2 = d.publish("A"), d.publish("A")
    b1 = d.publish("B")
    d.publish(None)
    d.bind("a")
    assert d.seqs("a") == [1, 3, 4]
    d.ack("a", a1)
    assert d.seqs("a") == [1, 3, 4, 2]
    d.ack("a", b1, a2)


def test_messages_without_key_have_no_key_constraint() -> None:
    d = make(key_order=KeyOrder.STRICT)
    [d.publish(None) for _ in range(3)]
    d.bind("a")
    assert d.seqs("a") == [1, 2, 3]


def test_a_scheduled_message_waits_without_holding_back_other_messages() -> None:
    d = make()
    d.publish("K", deliver_at=5.0)
    d.publish("K")
    d.publish("other")
    d.bind("a")
    assert d.seqs("a") == [2, 3]
    assert d.machine.next_deadline() == 5.0
    d.advance(5.0)
    assert d.seqs("a") == [2, 3, 1]


def test_expired_messages_are_dropped_and_settled() -> None:
    d = make()
    d.publish("k", expire_at=1.0)
    d.publish("k")
    d.advance(2.0)
    d.bind("a")
    assert d.seqs("a") == [2]
    assert [x.reason for x in d.dropped] == ["expired"]
    assert d.settled(0, 1)


def test_expired_messages_are_dead_lettered_when_the_queue_asks() -> None:
    d = make(dead_letter_expired=True)
    d.bind("a", window=1)
    d.publish("k")
    d.publish("k", expire_at=1.0)
    d.advance(1.0)
    assert [(x.reason, x.message.seq) for x in d.dead] == [(DeadLetterReason.EXPIRED, 2)]


def test_tag_filter_drops_messages_that_do_not_match() -> None:
    d = make_group(GroupConfig("q", "g", tags={"region": "eu", "vip": "true"}))
    d.bind("a")
    d.publish("k", properties={"region": "eu", "vip": True})
    d.publish("k", properties={"region": "us", "vip": True})
    d.publish("k", properties={"region": b"eu"})
    assert d.seqs("a") == [1]
    assert [(x.message.seq, x.reason) for x in d.dropped] == [(2, "filtered"), (3, "filtered")]


# -- assignment, rebalance, handoff ----------------------------------------------------------


def test_another_user_cannot_take_back_a_reservation_by_naming_its_client() -> None:
    """A reservation is for the client *of its user*: mallory naming alice's client gets
    no partitions back early; alice's own reconnect does."""
    d = make(partitions=4)
    d.bind("a", client="c1", owner="alice")
    d.bind("b", client="c2", owner="bob")
    held = d.machine.partitions_of("a")
    d.call(d.machine.unbind, "a")
    d.advance(1.0)
    d.bind("m", client="c1", previous=held, owner="mallory")
    assert not d.machine.partitions_of("m") & held  # at most a fair share of bob's
    assert all(d.assignment[p] == (PartitionState.UNBOUND, "a") for p in held)
    d.bind("a2", client="c1", previous=held, owner="alice")
    assert d.machine.partitions_of("a2") == held


def test_reconnect_within_rebalance_delay_keeps_partitions() -> None:
    d = make(partitions=4)
    d.bind("a", client="c1")
    d.bind("b", client="c2")
    [d.publish("k", partition=p) for p in range(4)]
    held = d.machine.partitions_of("a")
    assert len(held) == 2
    d.call(d.machine.unbind, "a")
    assert all(d.assignment[p] == (PartitionState.UNBOUND, "a") for p in held)
    assert d.machine.partitions_of("b") == frozenset(range(4)) - held
    d.advance(2.0)
    d.bind("a2", client="c1", previous=held)
    assert d.machine.partitions_of("a2") == held
    again = [x for x in d.deliveries if x.flow_id == "a2"]
    assert {x.message.partition for x in again} == held
    assert all(x.redelivered and x.delivery_count == 2 for x in again)
    d.advance(10.0)
    assert d.machine.partitions_of("a2") == held


def test_two_flows_of_one_client_each_reclaim_their_own_previous_set() -> None:
    d = make(partitions=6)
    d.bind("a1", client="c1")
    d.bind("a2", client="c1")
    d.bind("b", client="c2")
    held = {f: d.machine.partitions_of(f) for f in ("a1", "a2", "b")}
    assert all(len(p) == 2 for p in held.values())
    d.call(d.machine.unbind, "a1")
    d.call(d.machine.unbind, "a2")
    d.advance(1.0)
    # Re-bound in the other order: each new flow gets the set it names, not its sibling's.
    d.bind("a2-again", client="c1", previous=held["a2"])
    d.bind("a1-again", client="c1", previous=held["a1"])
    assert d.machine.partitions_of("a1-again") == held["a1"]
    assert d.machine.partitions_of("a2-again") == held["a2"]
    assert d.machine.partitions_of("b") == held["b"]


def test_a_rebind_after_a_newcomer_joined_gets_its_set_back_less_what_balance_moves() -> None:
    """docs/operations.md, Reconnect identity: the newcomer did not take the reserved
    partitions; the re-bind reclaims them and the same rebalance keeps the group balanced."""
    d = make(partitions=8)
    d.bind("a", client="c1")
    d.bind("b", client="c2")
    held = d.machine.partitions_of("a")
    d.call(d.machine.unbind, "a")
    d.bind("c", client="c3")
    assert not d.machine.partitions_of("c") & held  # reserved, not given away
    assert len(d.machine.partitions_of("c")) == 2
    d.advance(1.0)
    d.bind("a2", client="c1", previous=held)
    back = d.machine.partitions_of("a2")
    assert len(back) == 3 and back < held
    assert sorted(len(d.machine.partitions_of(f)) for f in ("a2", "b", "c")) == [2, 3, 3]


def test_a_restarted_client_without_previous_set_is_treated_as_new() -> None:
    d = make(partitions=2)
    d.bind("a", client="c1")
    d.bind("b", client="c2")
    d.call(d.machine.unbind, "a")
    d.bind("a2", client="c1")
    assert d.machine.partitions_of("a2") == frozenset()
    d.advance(5.0)
    assert len(d.machine.partitions_of("a2")) == 1
    assert len(d.machine.partitions_of("b")) == 1


def test_a_previous_set_sent_after_expiry_is_ignored() -> None:
    d = make(partitions=2)
    d.bind("a", client="c1")
    d.bind("b", client="c2")
    held = d.machine.partitions_of("a")
    d.call(d.machine.unbind, "a")
    d.advance(5.0)
    assert d.machine.partitions_of("b") == frozenset({0, 1})
    d.bind("a2", client="c1", previous=held)
    # The newcomer rebalance moves one partition back through a handoff (nothing in flight).
    assert len(d.machine.partitions_of("a2")) == 1


def test_shutdown_reassigns_partitions_at_once() -> None:
    d = make(partitions=2)
    d.bind("a")
    d.bind("b")
    d.call(d.machine.unbind, "a", shutdown=True)
    assert d.machine.partitions_of("b") == frozenset({0, 1})


def test_a_newcomer_beyond_the_partition_count_is_standby() -> None:
    d = make(partitions=2)
    d.bind("a")
    d.bind("b")
    actions = d.bind("c")
    assert d.machine.partitions_of("c") == frozenset()
    assert [type(a).__name__ for a in actions] == ["FlowChanged"]
    d.call(d.machine.unbind, "a", shutdown=True)
    assert len(d.machine.partitions_of("c")) == 1


def test_a_newcomer_gets_the_other_keys_at_once_and_a_busy_key_after_the_old_owners_ack() -> None:
    d = make(partitions=2)
    m0 = d.publish("k", partition=0)
    m1 = d.publish("k", partition=1)
    d.bind("a")
    d.bind("b")
    moving = 1 if d.assignment[1][0] is PartitionState.PAUSED else 0
    assert d.assignment[moving] == (PartitionState.PAUSED, "b")
    later = d.publish("k", partition=moving)
    other = d.publish("j", partition=moving)
    assert d.received("b") == [other]  # key j flows at once; k waits for a's ack
    d.ack("a", m1 if moving == 1 else m0)
    assert d.assignment[moving] == (PartitionState.READY, "b")
    assert d.received("b") == [other, later]


def test_handoff_timeout_redelivers_leftovers_first_to_the_new_owner() -> None:
    d = make(partitions=2)
    d.publish("k", partition=1)
    d.publish("k", partition=0)
    d.bind("a")
    d.bind("b")
    moving = next(p for p, (state, _) in d.assignment.items() if state is PartitionState.PAUSED)
    d.publish("k", partition=moving)
    d.advance(3.0)
    got = [(x.message.seq, x.delivery_count) for x in d.deliveries if x.flow_id == "b"]
    assert got == [(1, 2), (2, 1)]


def test_zero_max_handoff_time_moves_partitions_at_once() -> None:
    d = make(partitions=2, max_handoff_time=0.0)
    d.publish("k", partition=0)
    d.publish("k", partition=1)
    d.bind("a")
    d.bind("b")
    assert [(x.flow_id, x.delivery_count) for x in d.deliveries][-1] == ("b", 2)


def test_exclusive_mode_standby_takes_over_after_the_rebalance_delay() -> None:
    d = make(partitions=3, mode=GroupMode.EXCLUSIVE)
    d.bind("a")
    d.bind("b")
    assert d.machine.partitions_of("a") == frozenset({0, 1, 2})
    d.call(d.machine.unbind, "a")
    assert d.machine.partitions_of("b") == frozenset()
    d.advance(5.0)
    assert d.machine.partitions_of("b") == frozenset({0, 1, 2})


def test_shared_mode_round_robins_within_windows() -> None:
    d = make(mode=GroupMode.SHARED)
    [d.publish(f"k{i}") for i in range(5)]
    d.bind("a", window=2)
    assert d.seqs("a") == [1, 2]
    d.bind("b", window=2)
    assert d.seqs("b") == [3, 4]
    d.ack("a", *d.received("a"))
    assert d.seqs("a") == [1, 2, 5]


def test_unbind_returns_unacked_messages_in_shared_mode() -> None:
    d = make(mode=GroupMode.SHARED)
    d.publish("k")
    d.bind("a")
    d.bind("b")
    d.call(d.machine.unbind, "a")
    assert [(x.flow_id, x.delivery_count) for x in d.deliveries] == [("a", 1), ("b", 2)]


# -- memory, recovery, durability ------------------------------------------------------------


def _page(fetch: Fetch) -> tuple[int, int]:
    """Where a Fetch reads from and how many messages it asks for."""
    return fetch.after_seq, fetch.limit


def test_buffer_is_bounded_and_refilled_by_one_fetch_at_a_time() -> None:
    queue = QueueConfig("q")
    d = Driver(queue, GroupConfig("q", "g"), buffer_size=4, auto_fetch=False)
    d.bind("a", window=100)
    # One until it knows their size, reserving a 1 KiB message's cost of the budget.
    assert d.pending_fetches == {0: Fetch(0, 0, 1, 1024 + MESSAGE_OVERHEAD)}
    for _ in range(10):
        d.publish("k")
    assert set(d.pending_fetches) == {0}
    d.answer()
    assert d.seqs("a") == [1]
    assert _page(d.pending_fetches[0]) == (1, 4)
    d.answer()
    assert d.seqs("a") == list(range(1, 6))
    assert _page(d.pending_fetches[0]) == (5, 4)
    d.answer_fetches()
    assert d.seqs("a") == list(range(1, 11))


def test_appends_beyond_a_full_buffer_are_read_again_later() -> None:
    d = Driver(QueueConfig("q"), GroupConfig("q", "g"), buffer_size=2)
    d.bind("a", window=1)
    ms = [d.publish("k") for _ in range(6)]
    for m in ms:
        d.ack("a", m)
    assert d.seqs("a") == [1, 2, 3, 4, 5, 6]


def test_seq_gaps_in_storage_are_settled() -> None:
    store = {0: [Message(f"m{s}", "q", 0, s, "k", b"") for s in (2, 5)]}
    d = Driver(QueueConfig("q"), GroupConfig("q", "g"), store=store)
    d.bind("a")
    d.ack("a", *store[0])
    assert acked(d.offsets[0]) == (5, ())


def test_recovery_skips_acked_messages_and_counts_possibly_seen_ones() -> None:
    store = {0: [Message(f"m{s}", "q", 0, s, "k", b"") for s in range(1, 6)]}
    snapshot = GroupSnapshot(
        {
            0: PartitionSnapshot(
                committed_seq=1,
                acked_above=((3, 3),),
                dispatched_seq=4,
                deliveries=(DeliveryRecord(4, 3, 7.0),),
            )
        }
    )
    d = Driver(QueueConfig("q"), GroupConfig("q", "g"), store=store, snapshot=snapshot)
    d.bind("a")
    got = [(x.message.seq, x.delivery_count, x.redelivered) for x in d.deliveries]
    assert got == [(2, 2, True), (4, 4, True), (5, 1, False)]


def test_recovery_dead_letters_a_message_that_reached_max_deliveries() -> None:
    store = {0: [Message("m1", "q", 0, 1, "k", b"")]}
    snapshot = GroupSnapshot(
        {0: PartitionSnapshot(dispatched_seq=1, deliveries=(DeliveryRecord(1, 16, 3.0),))}
    )
    d = Driver(QueueConfig("q"), GroupConfig("q", "g"), store=store, snapshot=snapshot)
    d.bind("a")
    assert d.deliveries == []
    assert [(x.reason, x.delivery_count, x.first_delivery_time) for x in d.dead] == [
        (DeadLetterReason.MAX_DELIVERIES, 16, 3.0)
    ]
    assert acked(d.offsets[0]) == (1, ())


def test_close_emits_the_final_offsets_only() -> None:
    d = make(partitions=2)
    m = d.publish("k", partition=1)
    d.bind("a")
    d.ack("a", m)
    # Partition 1 gives its dispatch reservation back: nothing unsent counts after a restart.
    assert d.machine.close() == [OffsetUpdate(0, 0, ()), OffsetUpdate(1, 1, (), 1, 1)]


def test_status_shows_partitions_and_flows() -> None:
    d = make(partitions=2)
    d.publish("k", partition=0)
    d.bind("a", client="c", window=5)
    status = d.machine.status()
    assert [(p.state, p.flow_id, p.client, p.in_flight) for p in status.partitions] == [
        (PartitionState.READY, "a", "c", 1),
        (PartitionState.READY, "a", "c", 0),
    ]
    (flow,) = status.flows
    assert (flow.flow_id, flow.window, flow.pending, flow.partitions) == (
        "a",
        5,
        1,
        frozenset({0, 1}),
    )


def test_next_deadline_is_none_when_nothing_is_scheduled() -> None:
    d = make()
    d.bind("a")
    assert d.machine.next_deadline() is None
    assert not any(isinstance(a, Deliver | Dropped) for a in d.advance(100.0))


def test_an_auto_ack_flow_with_window_zero_is_paused() -> None:
    d = make()
    d.publish("k")
    d.bind("a", window=0, ack_mode=AckMode.AUTO)
    assert d.deliveries == []
    d.call(d.machine.credit, "a", 1)
    assert d.seqs("a") == [1]


def test_exclusive_flow_reconnecting_with_its_previous_set_stays_active() -> None:
    d = make(partitions=2, mode=GroupMode.EXCLUSIVE)
    d.bind("a", client="c1")
    d.bind("b", client="c2")
    d.call(d.machine.unbind, "a")
    d.bind("a2", client="c1", previous=frozenset({0, 1}))
    assert d.machine.partitions_of("a2") == frozenset({0, 1})
    d.advance(10.0)
    assert d.machine.partitions_of("b") == frozenset()


def test_a_newcomer_during_a_reservation_only_shares_the_free_partitions() -> None:
    d = make(partitions=4)
    d.bind("a", client="c1")
    d.bind("b", client="c2")
    held = d.machine.partitions_of("a")
    d.call(d.machine.unbind, "a")
    d.bind("c", client="c3")
    assert d.machine.partitions_of("b") | d.machine.partitions_of("c") == frozenset(range(4)) - held
    assert len(d.machine.partitions_of("c")) == 1
    d.advance(5.0)
    assert sorted(len(d.machine.partitions_of(f)) for f in ("b", "c")) == [2, 2]


def test_ack_cumulative_only_settles_the_flows_own_messages() -> None:
    d = make(mode=GroupMode.EXCLUSIVE)
    [d.publish("k") for _ in range(3)]
    d.bind("a", window=2)
    before = d.offsets.get(0)
    d.call(d.machine.ack_cumulative, "other", 0, 3)
    assert d.offsets.get(0) == before
    d.call(d.machine.ack_cumulative, "a", 0, 3)
    assert acked(d.offsets[0]) == (2, ())
    assert d.seqs("a") == [1, 2, 3]


def test_messages_of_a_partition_out_of_range_are_refused() -> None:
    d = make(partitions=2)
    with pytest.raises(InvalidArgument):
        d.machine.loaded(0.0, [Page(2, [])])
    with pytest.raises(InvalidArgument):
        d.machine.append(0.0, [Message("m", "q", 5, 1, None, b"")])


def test_reconfigured_backoff_applies_to_the_next_nack() -> None:
    d = make()
    m = d.publish("k")
    d.bind("a")
    d.machine.reconfigure(QueueConfig("q", backoff_initial=5.0))
    d.nack("a", m)
    assert d.machine.next_deadline() == 5.0


def test_reconfigure_refuses_a_different_partition_count() -> None:
    d = make()
    with pytest.raises(InvalidArgument):
        d.machine.reconfigure(QueueConfig("q", partitions=4))


def _machine_at(committed: int) -> GroupMachine:
    snapshot = GroupSnapshot({0: PartitionSnapshot(committed_seq=committed)})
    return GroupMachine(QueueConfig("q"), GroupConfig("q", "g"), now=0.0, snapshot=snapshot)


def test_an_append_during_a_fetch_whose_query_missed_it_is_read_again_not_lost() -> None:
    machine = _machine_at(10)
    machine.bind(0.0, "a", "a", 10, AckMode.CLIENT)
    eleven = Message("m11", "q", 0, 11, "k", b"")
    assert machine.append(0.0, [eleven]) == []  # a Fetch is outstanding: dropped for now
    again = [a for a in machine.loaded(0.0, [Page(0, [])]) if isinstance(a, Fetch)]
    assert [_page(a) for a in again] == [
        (10, again[0].limit)
    ]  # the empty answer predates 11's commit
    sent = [a for a in machine.loaded(0.0, [Page(0, [eleven])]) if isinstance(a, Deliver)]
    assert [d.message.seq for d in sent] == [11]


def test_an_appended_seq_past_a_gap_is_fetched_rather_than_settling_the_gap() -> None:
    machine = _machine_at(10)
    machine.bind(0.0, "a", "a", 10, AckMode.CLIENT)
    machine.loaded(0.0, [Page(0, [])])
    twelve = Message("m12", "q", 0, 12, "k", b"")
    actions = machine.append(0.0, [twelve])
    assert not any(isinstance(a, OffsetUpdate) for a in actions)  # 11 is not settled
    # One message: the group has not seen one yet, so it cannot tell how many fit.
    assert [_page(a) for a in actions if isinstance(a, Fetch)] == [(10, 1)]


@pytest.mark.parametrize(("client", "window"), [("c" * 600, 10), ("a", 3_000_000_000)])
def test_a_bind_that_kg_flows_cannot_hold_is_refused_and_the_group_keeps_delivering(
    client: str, window: int
) -> None:
    d = make()
    ms = [d.publish(f"k{i}") for i in range(3)]
    with pytest.raises(InvalidArgument):
        d.machine.bind(0.0, "bad", client, window, AckMode.CLIENT)
    d.bind("a", window=10)
    assert d.received("a") == ms


def test_a_message_the_owner_cannot_encode_is_dead_lettered_as_undeliverable() -> None:
    d = make()
    poison, after = d.publish("k"), d.publish("k")
    d.bind("a", window=1)
    assert d.received("a") == [poison]
    d.call(d.machine.undeliverable, "a", [poison.message_id])
    assert [(x.message, x.reason) for x in d.dead] == [(poison, DeadLetterReason.UNDELIVERABLE)]
    assert d.settled(0, poison.seq)
    assert d.received("a") == [poison, after]


def test_a_head_another_writer_advanced_is_fetched_and_delivered() -> None:
    d = make()
    d.bind("a")
    d.publish("k")
    # Another writer commits seqs 2 and 3; only the partition head tells the group.
    d.store[0] += [Message(f"x{seq}", "q", 0, seq, "k", b"x") for seq in (2, 3)]
    assert d.seqs("a") == [1]
    d.call(d.machine.heads, {0: 3})
    assert d.seqs("a") == [1, 2, 3]
    # A head already known asks storage for nothing.
    assert not [a for a in d.call(d.machine.heads, {0: 3}) if isinstance(a, Fetch)]


# -- what a bind answers (BIND_OK) and what follows it -------------------------------------


def test_a_bind_announces_no_partitions_changed_for_the_new_flow_its_answer_carries_them() -> None:
    d = make(partitions=4)
    actions = d.bind("a")
    assert not [a for a in actions if isinstance(a, PartitionsChanged)]
    assert d.machine.partitions_of("a") == frozenset(range(4))
    # A later change is announced, to every flow it changes, the newcomer's set included.
    actions = d.bind("b")
    changed = {a.flow_id: a.partitions for a in actions if isinstance(a, PartitionsChanged)}
    assert changed == {"a": d.machine.partitions_of("a")}
    assert len(d.machine.partitions_of("a")) == len(d.machine.partitions_of("b")) == 2
    d.call(d.machine.unbind, "b", shutdown=True)
    assert d.partitions["a"] == frozenset(range(4))


@pytest.mark.parametrize("partitions", [0, 3])
def test_a_shared_flow_is_served_from_every_partition_and_never_standby(partitions: int) -> None:
    d = make(partitions=partitions, mode=GroupMode.SHARED)
    d.bind("a")
    d.bind("b")
    every = frozenset(range(max(1, partitions)))
    assert d.machine.partitions_of("a") == d.machine.partitions_of("b") == every


def test_an_exclusive_standby_flow_holds_no_partitions() -> None:
    d = make(partitions=2, mode=GroupMode.EXCLUSIVE)
    d.bind("a")
    d.bind("b")
    assert (d.machine.partitions_of("a"), d.machine.partitions_of("b")) == ({0, 1}, frozenset())
