"""Every gateway setting is checked once, whatever its source (TOML file, ``KEYGATE_*``
environment, CLI flag): a bad value is one ``ConfigError`` naming the setting, where it
came from, the value and what is expected (QA D4)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config, settings_reference


def _toml(tmp_path: Path, text: str) -> Path:
    file = tmp_path / "cfg.toml"
    file.write_text(text)
    return file


@pytest.mark.parametrize(
    ("text", "setting", "value", "expected"),
    [
        ('lease_ttl = "abc"\n', "lease_ttl", "'abc'", "number"),
        ("lease_ttl = -1\n", "lease_ttl", "-1", "> 0"),
        ("lease_ttl = nan\n", "lease_ttl", "nan", "number"),
        ("lease_ttl = true\n", "lease_ttl", "True", "number"),
        ("ack_flush_interval = 0\n", "ack_flush_interval", "0", "> 0"),
        ('log_json = "maybe"\n', "log_json", "'maybe'", "true or false"),
        ("buffer_size = 1.5\n", "buffer_size", "1.5", "integer"),
        ("max_window = -5\n", "max_window", "-5", "between 1 and 2147483647"),
        ("max_window = 2147483648\n", "max_window", "2147483648", "between 1 and"),
        ("max_connections = -1\n", "max_connections", "-1", ">= 0"),
        ('log_level = "LOUD"\n', "log_level", "'LOUD'", "one of DEBUG, INFO"),
        ("db = 5\n", "db", "5", "string"),
        ('name = ""\n', "name", "''", "non-empty"),
        ("users = 5\n", "users", "5", "table"),
        ("ports = 5\n", "ports", "5", "table"),
        ("permissions = 5\n", "permissions", "5", "table"),
        ("certificate_users = 5\n", "certificate_users", "5", "table"),
        ("[users]\nalice = 5\n", "users.alice", "<int>", "password hash"),
        ("[ports]\nmqtt = 70000\n", "ports.mqtt", "70000", "0-65535"),
        ("[ports]\nmqtt = true\n", "ports.mqtt", "True", "0-65535"),
        ("[permissions]\nalice = 5\n", "permissions.alice", "5", "table"),
        ('[permissions.alice]\npublish = "orders"\n', "permissions.alice.publish", "'orders'",
         "list of queue globs"),
        ('[permissions.alice]\nadmin = "yes"\n', "permissions.alice.admin", "'yes'",
         "true or false"),
        ('http_allowed_hosts = "a.example"\n', "http_allowed_hosts", "'a.example'",
         "list of names"),
        ('http_allowed_hosts = ["a.example", 5]\n', "http_allowed_hosts", "5", "list of names"),
        ('http_allowed_hosts = [""]\n', "http_allowed_hosts", "['']", "list of names"),
    ],
)  # fmt: skip
def test_a_bad_value_in_the_file_names_the_file_key_value_and_what_is_expected(
    tmp_path: Path, text: str, setting: str, value: str, expected: str
) -> None:
    file = _toml(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config(file, env={})
    message = caught.value.message
    assert f"{file}:{setting}" in message
    assert value in message
    assert expected in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("variable", "raw", "expected"),
    [
        ("KEYGATE_LEASE_TTL", "abc", "number"),
        ("KEYGATE_LEASE_TTL", "inf", "number"),
        ("KEYGATE_MAX_CONNECTIONS", "many", "integer"),
        ("KEYGATE_MAX_CONNECTIONS", "1.5", "integer"),
        ("KEYGATE_LOG_JSON", "on-ish", "true or false"),
        ("KEYGATE_LOG_JSON", "", "true or false"),
        ("KEYGATE_NATIVE_IDLE_TIMEOUT", "-3", ">= 0"),
        ("KEYGATE_BUFFER_SIZE", "0", ">= 1"),
        ("KEYGATE_LOG_LEVEL", "LOUD", "one of DEBUG"),
        ("KEYGATE_NATIVE_PORT", "many", "0-65535"),
    ],
)
def test_a_bad_environment_value_names_the_variable_value_and_what_is_expected(
    variable: str, raw: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(env={variable: raw})
    message = caught.value.message
    assert variable in message
    assert repr(raw) in message
    assert expected in message


def test_a_bad_users_variable_is_refused_without_echoing_its_passwords() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(env={"KEYGATE_USERS": "alice:HASH,bob-secret"})
    message = caught.value.message
    assert "KEYGATE_USERS" in message and "entry 2 of 2" in message
    assert "user:password-hash" in message
    assert "secret" not in message and "HASH" not in message


@pytest.mark.parametrize(
    ("overrides", "flag", "expected"),
    [
        ({"amqp_port": "abc"}, "--amqp-port", "0-65535"),
        ({"amqp_port": "70000"}, "--amqp-port", "0-65535"),
        ({"lease_ttl": 0}, "lease_ttl", "> 0"),
    ],
)
def test_a_bad_flag_or_override_is_refused_the_same_way(
    overrides: dict[str, object], flag: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(env={}, overrides=overrides)
    assert flag in caught.value.message and expected in caught.value.message


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("1", True), ("true", True), ("TRUE", True), ("yes", True), ("On", True),
        ("0", False), ("false", False), ("No", False), ("off", False), (" off ", False),
    ],
)  # fmt: skip
def test_booleans_from_the_environment_take_the_documented_spellings(raw: str, value: bool) -> None:
    assert load_config(env={"KEYGATE_LOG_JSON": raw}).log_json is value


def test_good_values_are_read_with_their_types(tmp_path: Path) -> None:
    file = _toml(
        tmp_path,
        'lease_ttl = 3\nlog_level = "debug"\nnative_idle_timeout = 0\nmax_connections = 0\n'
        'tls_ca = ""\n',
    )
    config = load_config(
        file, env={"KEYGATE_ACK_FLUSH_INTERVAL": "0.5", "KEYGATE_MAX_WINDOW": " 20 "}
    )
    assert config.lease_ttl == 3.0 and isinstance(config.lease_ttl, float)
    assert config.log_level == "DEBUG"
    assert config.native_idle_timeout == 0.0
    assert config.max_connections == 0
    assert config.tls_ca is None
    assert config.ack_flush_interval == 0.5
    assert config.max_window == 20


def test_a_list_is_a_toml_array_or_comma_separated_text(tmp_path: Path) -> None:
    file = _toml(tmp_path, 'http_allowed_hosts = ["a.example", "B.example"]\n')
    assert load_config(file, env={}).http_allowed_hosts == ("a.example", "B.example")
    variable = {"KEYGATE_HTTP_ALLOWED_HOSTS": " a.example, b.example ,"}
    assert load_config(env=variable).http_allowed_hosts == ("a.example", "b.example")
    assert load_config(env={}).http_allowed_hosts == ()


def test_the_first_bad_value_is_reported_before_anything_else_is_read(tmp_path: Path) -> None:
    """The file is checked before the environment: an error names the earliest source."""
    file = _toml(tmp_path, "lease_ttl = -1\n")
    with pytest.raises(ConfigError, match=r"cfg\.toml:lease_ttl"):
        load_config(file, env={"KEYGATE_MAX_WINDOW": "x"})


def test_a_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.toml"):
        load_config(tmp_path / "nope.toml", env={})


def test_the_operations_guide_lists_every_setting_as_the_table_describes_it() -> None:
    guide = (Path(__file__).parents[3] / "docs" / "operations.md").read_text()
    assert settings_reference() in guide


def test_every_setting_of_the_configuration_has_a_row_or_is_a_table() -> None:
    from dataclasses import fields

    from gateway.config import GatewayConfig
    from gateway.settings import BY_NAME

    tables = {"ports", "users", "permissions", "certificate_users"}
    assert {f.name for f in fields(GatewayConfig)} == set(BY_NAME) | tables
