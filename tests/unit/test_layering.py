"""DESIGN.md §1: dependencies point downward, and core/ does no I/O."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
OURS = {"core", "storage", "protocols", "gateway", "spark"}
ALLOWED = {
    "core": {"core"},
    "storage": {"core", "storage"},
    "protocols": {"core", "protocols"},
    "spark": {"core", "storage", "spark"},
    "gateway": OURS - {"spark"},
}
IO_MODULES = {
    "asyncio",
    "socket",
    "sqlalchemy",
    "sqlite3",
    "asyncpg",
    "aiosqlite",
    "psycopg",
    "ssl",
    "selectors",
    "threading",
    "subprocess",
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_package_imports_only_the_layers_below_it(package: str) -> None:
    for path in sorted((ROOT / package).rglob("*.py")):
        if "examples" in path.parts:
            continue
        ours = _imports(path) & OURS
        extra = ours - ALLOWED[package]
        assert not extra, f"{path.relative_to(ROOT)} imports {extra}"


def test_core_does_no_io() -> None:
    for path in sorted((ROOT / "core").rglob("*.py")):
        io = _imports(path) & IO_MODULES
        assert not io, f"{path.relative_to(ROOT)} imports {io}"


# The asyncio side of protocols/: each package's listener and session (a connection's
# sockets and its ordered work), the kit they share, and a few helpers of theirs.
# Everything else there is sans-IO (codecs, connection state machines, mappings),
# testable with bytes alone.
PROTOCOL_ADAPTER_NAMES = {"listener.py", "session.py"}
PROTOCOL_ADAPTERS = {
    "protocols/_accept.py",  # the server socket and one task per connection
    "protocols/_intake.py",  # a connection's reads, which a draining listener stops
    "protocols/_io.py",  # the shared outbox writer, heartbeats, publish pipeline
    "protocols/_limits.py",  # the byte budget a reader waits on
    "protocols/_queue.py",  # the ordered work queue between a reader and its worker
    "protocols/_tasks.py",  # the owner of a connection's tasks
    "protocols/sink.py",  # the Listener protocol's start() takes an ssl context
    "protocols/amqp/flows.py",
    "protocols/mqtt/clients.py",  # Will tasks, session takeover
    "protocols/mqtt/pipeline.py",  # the publish worker
    "protocols/mqtt/stored_session.py",
    "protocols/native/requests.py",
}


def test_protocol_machines_do_no_io() -> None:
    for path in sorted((ROOT / "protocols").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        if path.name in PROTOCOL_ADAPTER_NAMES or name in PROTOCOL_ADAPTERS:
            continue
        io = _imports(path) & IO_MODULES
        assert not io, f"{name} imports {io}: I/O belongs in the listener"


# Every protocol package is laid out alike (STYLE.md "Protocols: sans-IO"): its events,
# its errors with the map from keygate errors to wire codes, the codec, the connection
# state machine, the mapping to keygate's model, and the listener.
PROTOCOL_FILES = {
    "events.py",
    "errors.py",
    "codec.py",
    "connection.py",
    "mapping.py",
    "listener.py",
}
PROTOCOL_PACKAGES = sorted(
    path.parent.name
    for path in (ROOT / "protocols").glob("*/__init__.py")
    if not path.parent.name.startswith("_")
)


def test_the_protocol_packages_are_the_four_protocols() -> None:
    assert PROTOCOL_PACKAGES == ["amqp", "mqtt", "native", "stomp"]


@pytest.mark.parametrize("package", PROTOCOL_PACKAGES)
def test_every_protocol_package_has_the_same_files(package: str) -> None:
    present = {path.name for path in (ROOT / "protocols" / package).glob("*.py")}
    assert not PROTOCOL_FILES - present, f"protocols/{package} lacks {PROTOCOL_FILES - present}"
