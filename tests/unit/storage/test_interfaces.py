"""SqlStore provides every storage interface and MemoryStore the two it twins: mypy checks
the signatures (the end of storage/interfaces.py), these tests that every call exists."""

from __future__ import annotations

import pytest

from storage import SqlStore
from storage.interfaces import AdminStore, GroupStore, PublishStore
from storage.memory import MemoryStore


def _calls(interface: type) -> set[str]:
    return {name for name in vars(interface) if not name.startswith("_")}


@pytest.mark.parametrize("interface", [PublishStore, GroupStore, AdminStore])
def test_sql_store_has_every_call_of_each_interface(interface: type) -> None:
    assert _calls(interface) <= set(dir(SqlStore))


@pytest.mark.parametrize("interface", [PublishStore, GroupStore])
def test_memory_store_has_every_call_of_the_interfaces_it_twins(interface: type) -> None:
    assert _calls(interface)
    assert _calls(interface) <= set(dir(MemoryStore))
