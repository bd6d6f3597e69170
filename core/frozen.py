"""``frozen``: the dataclass decorator of the value classes built for every message.

A ``@dataclass(frozen=True)`` pays one ``object.__setattr__`` call per field in its
``__init__``: 1.9 µs for 18 fields against 0.3 µs for a plain slotted dataclass (CPython
3.11), and a publish passes through four such objects on its way in (the decoded event, a
``Publication``, a ``Message`` and the ``Message`` with its seq), a delivery through two
or three. In the gateway's profiles those ``__init__``s were 15 to 17 % of all samples.

``frozen`` builds a plain slotted dataclass whose hash is computed from its fields, as a
frozen one's is, and tells type checkers (PEP 681, ``frozen_default``) that its instances
are frozen: mypy rejects an assignment to a field exactly as it does for
``frozen=True``. What is given up is only the runtime check against code that bypasses
the type checker. Everything not on the per-message path stays
``@dataclass(frozen=True, slots=True)``.

``bare`` is for the few places that build one such object per message with keywords.
Calling a class with keywords makes CPython 3.11 pack them into a dict for
``type.__call__`` and unpack it again for ``__init__``: a native DELIVER frame built with
its 14 fields named took 1.97 µs, a ``Publication`` with 12 1.95 µs. Calling ``__init__``
itself takes the keywords as they are, so

    frame = bare(Deliver)
    Deliver.__init__(frame, flow_id=..., message_id=..., ...)

costs 1.23 and 1.38 µs, keeps the names at the call site, and is checked by mypy as the
constructor is. Up to 14 keywords only: with more, the compiler builds a dict of them at
the call site anyway (``Message``'s 17 are passed positionally, gateway/messages.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, dataclass_transform, overload

T = TypeVar("T")

__all__ = ["bare", "frozen"]


@overload
def frozen(cls: type[T], /) -> type[T]: ...
@overload
def frozen(*, kw_only: bool = False, eq: bool = True) -> Callable[[type[T]], type[T]]: ...


@dataclass_transform(frozen_default=True)
def frozen(cls: type[T] | None = None, /, *, kw_only: bool = False, eq: bool = True) -> Any:
    """``eq=False``: compared and hashed by identity, like ``@dataclass(eq=False)``."""

    def build(c: type[T]) -> type[T]:
        return dataclass(slots=True, eq=eq, unsafe_hash=eq, kw_only=kw_only)(c)

    return build if cls is None else build(cls)


def bare(cls: type[T], /) -> T:
    """An instance of ``cls`` whose ``__init__`` has not run yet: call it next."""
    instance: T = object.__new__(cls)
    return instance
