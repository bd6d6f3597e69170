"""Configuration precedence: defaults < TOML file < KEYGATE_* environment < overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import InvalidArgument
from gateway.config import DEFAULT_PORTS, load_config


def test_defaults_are_the_standard_ports_and_an_sqlite_file() -> None:
    config = load_config(env={})
    assert dict(config.ports) == DEFAULT_PORTS
    assert config.db == "sqlite:///keygate.db"


def test_file_then_environment_then_overrides_win(tmp_path: Path) -> None:
    file = tmp_path / "keygate.toml"
    file.write_text(
        'db = "sqlite:///from-file.db"\nhost = "127.0.0.1"\n'
        '[ports]\nmqtt = "off"\nnative = 1000\n[users]\nalice = "pw"\n'
        '[permissions.alice]\npublish = ["orders*"]\n'
    )
    config = load_config(
        file,
        env={"KEYGATE_NATIVE_PORT": "2000", "KEYGATE_DB": "sqlite:///env.db"},
        overrides={"db": "sqlite:///flag.db", "amqp_port": "0"},
    )
    assert config.db == "sqlite:///flag.db"
    assert config.port("native") == 2000
    assert config.port("mqtt") is None
    assert config.port("amqp") == 0
    assert config.host == "127.0.0.1"
    assert config.permission("alice").allows("publish", "orders-eu")
    assert not config.permission("alice").allows("publish", "billing")


@pytest.mark.parametrize("bad", ["70000", "-1", "many"])
def test_a_bad_port_is_refused_with_its_listener_named(bad: str) -> None:
    with pytest.raises(InvalidArgument, match="stomp port"):
        load_config(env={"KEYGATE_STOMP_PORT": bad})


def test_an_unknown_setting_in_the_file_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "keygate.toml"
    file.write_text("colour = 'blue'\n")
    with pytest.raises(InvalidArgument, match="colour"):
        load_config(file, env={})


def test_buffer_budgets_are_read_and_must_be_positive(tmp_path: Path) -> None:
    file = tmp_path / "keygate.toml"
    file.write_text("group_buffer_bytes = 1048576\n")
    config = load_config(file, env={"KEYGATE_GATEWAY_BUFFER_BYTES": "67108864"})
    assert (config.group_buffer_bytes, config.gateway_buffer_bytes) == (1 << 20, 64 << 20)
    assert load_config(env={}).group_buffer_bytes == 2 << 20
    with pytest.raises(InvalidArgument, match=r"group_buffer_bytes .* expected an integer >= 1"):
        load_config(env={"KEYGATE_GROUP_BUFFER_BYTES": "0"})
