"""Compact ack state of one (group, partition): a committed seq plus settled ranges above it.

Settled seqs above ``committed`` are kept as sorted, merged, inclusive ranges in two
parallel lists. Settling a seq finds its place by bisection and merges with at most its
two neighbours; when the first range touches ``committed`` it is folded in, so advancing
the committed seq is amortised O(1) per settled message. Consumers ack roughly in order,
so the number of ranges (the only thing copied when the state is published) stays small.
"""

from __future__ import annotations

from bisect import bisect_right

from core.actions import SeqRanges


class AckLedger:
    def __init__(self, committed: int = 0, acked_above: SeqRanges = ()) -> None:
        self.committed = committed
        self._los: list[int] = []
        self._his: list[int] = []
        for lo, hi in acked_above:
            self.settle_range(lo, hi)

    def is_settled(self, seq: int) -> bool:
        if seq <= self.committed:
            return True
        if not self._los:
            return False
        index = bisect_right(self._los, seq) - 1
        return index >= 0 and self._his[index] >= seq

    def settle(self, seq: int) -> bool:
        """Mark ``seq`` settled; False when it already was."""
        if seq == self.committed + 1 and not self._los:  # acked in order: most acks
            self.committed = seq
            return True
        return self.settle_range(seq, seq)

    def settle_range(self, lo: int, hi: int) -> bool:
        """Mark every seq in ``lo..hi`` settled; False when all of them already were."""
        lo = max(lo, self.committed + 1)
        if lo > hi:
            return False
        # Ranges overlapping or adjacent to lo..hi are merged into one.
        start = bisect_right(self._his, lo - 2)
        end = bisect_right(self._los, hi + 1)
        if start < end:
            if self._los[start] <= lo and self._his[start] >= hi:
                return False
            lo = min(lo, self._los[start])
            hi = max(hi, self._his[end - 1])
        self._los[start:end] = [lo]
        self._his[start:end] = [hi]
        if self._los[0] == self.committed + 1:
            self.committed = self._his[0]
            del self._los[0]
            del self._his[0]
        return True

    def ranges(self) -> SeqRanges:
        return tuple(zip(self._los, self._his, strict=True))
