"""SqlStore and its in-memory twin provide every storage interface: mypy checks the
signatures (the end of storage/interfaces.py), these tests that every call exists."""

from __future__ import annotations

import pytest

from storage import SqlStore
from storage.interfaces import AdminStore, GroupStore, PublishStore
from storage.memory import MemoryStore


@pytest.mark.parametrize("store", [SqlStore, MemoryStore])
@pytest.mark.parametrize("interface", [PublishStore, GroupStore, AdminStore])
def test_both_stores_have_every_call_of_each_interface(store: type, interface: type) -> None:
    calls = {name for name in vars(interface) if not name.startswith("_")}
    assert calls
    assert calls <= set(dir(store))
