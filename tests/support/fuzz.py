"""Fuzzing helpers shared by the codec and listener fuzz tests.

CI runs every fuzz test with a small number of examples (seconds in all). For a longer
run set ``KEYGATE_FUZZ_EXAMPLES`` (e.g. ``KEYGATE_FUZZ_EXAMPLES=20000``); it replaces the
example count of every fuzz test, and the run is randomised as usual by Hypothesis (a
failure prints the seed and the shrunk input to reproduce it).

``mutated`` starts from valid frames and breaks them the ways a fuzzer finds bugs: flipped
bytes, inserted junk, cut frames, repeated runs and long runs of digits (numbers in
headers and length fields).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Final

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

ENV_EXAMPLES: Final = "KEYGATE_FUZZ_EXAMPLES"


def fuzz_settings(examples: int) -> settings:
    """``examples`` in CI; ``$KEYGATE_FUZZ_EXAMPLES`` when set (a longer run)."""
    override = os.environ.get(ENV_EXAMPLES)
    return settings(
        max_examples=int(override) if override else examples,
        deadline=None,
        # A gateway-level property test shares one gateway between its examples.
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,
        ],
    )


@st.composite
def mutated(draw: st.DrawFn, seeds: Sequence[bytes]) -> bytes:
    """One of ``seeds`` (a valid stream of frames) with zero to five mutations."""
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(0, 5))):
        at = draw(st.integers(0, len(data)))
        match draw(st.sampled_from(["flip", "insert", "delete", "digits", "repeat", "cut"])):
            case "flip" if data:
                data[min(at, len(data) - 1)] = draw(st.integers(0, 255))
            case "insert":
                data[at:at] = draw(st.binary(min_size=1, max_size=16))
            case "delete":
                del data[at : at + draw(st.integers(1, 16))]
            case "digits":
                data[at:at] = b"9" * draw(st.integers(1, 64))
            case "repeat":
                data[at:at] = data[at : at + draw(st.integers(1, 64))] * draw(st.integers(2, 20))
            case "cut":
                del data[at:]
    return bytes(data)


__all__ = ["ENV_EXAMPLES", "fuzz_settings", "mutated"]
