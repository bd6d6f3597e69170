"""The compact ack state: committed seq plus merged ranges."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from core.ledger import AckLedger


def test_in_order_settles_advance_the_committed_seq() -> None:
    ledger = AckLedger()
    for seq in (1, 2, 3):
        assert ledger.settle(seq)
    assert (ledger.committed, ledger.ranges()) == (3, ())


def test_out_of_order_settles_are_kept_as_merged_ranges() -> None:
    ledger = AckLedger(committed=2)
    for seq in (5, 7, 6, 10):
        ledger.settle(seq)
    assert ledger.ranges() == ((5, 7), (10, 10))
    assert not ledger.settle(6)
    ledger.settle_range(3, 4)
    assert (ledger.committed, ledger.ranges()) == (7, ((10, 10),))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(0, 5))))
def test_ledger_equals_the_set_of_settled_seqs(ops: list[tuple[int, int]]) -> None:
    ledger = AckLedger()
    settled: set[int] = set()
    for lo, width in ops:
        if width == 0:  # settle() has a fast path of its own for in-order acks
            assert ledger.settle(lo) == (lo not in settled)
        else:
            ledger.settle_range(lo, lo + width)
        settled.update(range(lo, lo + width + 1))
    committed = 0
    while committed + 1 in settled:
        committed += 1
    assert ledger.committed == committed
    expanded = {s for lo, hi in ledger.ranges() for s in range(lo, hi + 1)}
    assert expanded == {s for s in settled if s > committed}
    pairs = ledger.ranges()
    assert all(a[1] + 1 < b[0] for a, b in itertools.pairwise(pairs))
    assert all(ledger.is_settled(s) for s in settled)
    assert not any(ledger.is_settled(s) for s in range(1, 67) if s not in settled)
