"""Gateway configuration: defaults < TOML file < ``KEYGATE_*`` environment < CLI flags.

A port is an int (0 = any free port) or ``None`` (listener off; spelt ``off`` in files,
environment and flags).

Every value is checked once, here, whatever its source: scalars by the settings table
(``gateway.settings``), the tables (``[ports]``, ``[users]``, ``[permissions.USER]``,
``[certificate_users]``) by their shape. A bad one is a ``ConfigError`` naming the
setting, its source, the value and what is expected; ``keygate serve`` prints it as one
line and exits 2 before opening anything.
"""

from __future__ import annotations

import fnmatch
import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from gateway.settings import BY_NAME, SETTINGS, ConfigError, bad
from protocols._limits import (
    DEFAULT_LOGIN_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_USER,
    DEFAULT_MAX_LOGIN_FRAME,
    DEFAULT_MAX_UNCONFIRMED_BYTES,
    ConnectionCounter,
    ConnectionLimits,
)

__all__ = [
    "DEFAULT_DB",
    "DEFAULT_PORTS",
    "FULL_PERMISSION",
    "LISTENERS",
    "PLAIN_LISTENERS",
    "TLS_LISTENERS",
    "ConfigError",
    "GatewayConfig",
    "Permission",
    "load_config",
    "parse_permission",
    "parse_port",
    "settings_reference",
]

PLAIN_LISTENERS: Final = ("native", "mqtt", "amqp", "stomp", "http")
# Each plain listener has a TLS twin, ``<name>_tls``, started only when a certificate is set.
TLS_LISTENERS: Final = tuple(f"{name}_tls" for name in PLAIN_LISTENERS)
LISTENERS: Final = PLAIN_LISTENERS + TLS_LISTENERS
DEFAULT_PORTS: Final = {
    "native": 55555,
    "mqtt": 1883,
    "amqp": 5672,
    "stomp": 61613,
    "http": 8080,
    "native_tls": 55556,
    "mqtt_tls": 8883,
    "amqp_tls": 5671,
    "stomp_tls": 61614,
    "http_tls": 8443,
}
DEFAULT_DB: Final = "sqlite:///keygate.db"


@dataclass(frozen=True, slots=True)
class Permission:
    """Glob patterns of queue names a user may publish to, consume from (which includes
    creating a group by binding) and monitor (inspect, depth, passive declare; consume
    implies it), and whether the user may administer queues, groups, subscriptions and
    AMQP exchanges. The default is no right at all: a user without an entry has none."""

    publish: tuple[str, ...] = ()
    consume: tuple[str, ...] = ()
    monitor: tuple[str, ...] = ()
    admin: bool = False

    def allows(self, action: str, queue: str) -> bool:
        if action == "monitor":
            if self.admin:
                return True
            patterns = self.monitor + self.consume
        else:
            patterns = self.publish if action == "publish" else self.consume
        return any(fnmatch.fnmatchcase(queue, p) for p in patterns)

    def monitors_every_queue(self) -> bool:
        """``admin``, or ``monitor``/``consume`` granted by the pattern ``*`` itself: what
        the gateway-wide ``/metrics`` needs. Asking ``allows("monitor", "*")`` instead
        would match the name ``*`` against the patterns, and ``?`` or ``[*]`` match it."""
        return self.admin or "*" in self.monitor + self.consume


# Every right: what anonymous clients get when the gateway has no users.
FULL_PERMISSION: Final = Permission(("*",), ("*",), ("*",), admin=True)
_PERMISSION_KEYS: Final = frozenset(("publish", "consume", "monitor", "admin"))


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    db: str = DEFAULT_DB
    host: str = "0.0.0.0"
    ports: Mapping[str, int | None] = field(default_factory=lambda: dict(DEFAULT_PORTS))
    ports_file: str | None = None
    # Security (docs/operations.md "Security"). No users = anonymous, from loopback only
    # unless allow_anonymous. Passwords are scrypt hashes unless allow_plaintext_passwords.
    users: Mapping[str, str] = field(default_factory=dict)
    permissions: Mapping[str, Permission] = field(default_factory=dict)
    allow_anonymous: bool = False
    # Without users, the admin HTTP port answers only under these names, localhost and IP
    # addresses (gateway/http_guard.py: DNS rebinding).
    http_allowed_hosts: tuple[str, ...] = ()
    allow_plaintext_passwords: bool = False
    # TLS listeners start only with a certificate; tls_ca turns on client certificates,
    # whose subject CN names a user (certificate_users maps a CN to another user name).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_require_client_cert: bool = False
    certificate_users: Mapping[str, str] = field(default_factory=dict)
    ack_flush_interval: float = 0.05
    retention_interval: float = 5.0
    # Active/standby: gateways sharing a database elect one active through a lease in SQL.
    lease_ttl: float = 10.0
    # Unsent messages kept in memory (docs/operations.md "Limits"): at most buffer_size per
    # (group, partition), group_buffer_bytes per group (buffered and being read, in pages
    # of about a turn each) and gateway_buffer_bytes for all groups (split evenly across
    # the loaded ones).
    buffer_size: int = 1000
    group_buffer_bytes: int = 2 * 1024 * 1024
    gateway_buffer_bytes: int = 256 * 1024 * 1024
    # The largest window a consumer gets: a larger BIND or CREDIT window is clamped to it.
    max_window: int = 10_000
    # Bytes a consumer connection may have waiting in the gateway's write buffer: above it
    # no more deliveries are handed to the socket; they resume below a quarter of it.
    consumer_write_buffer: int = 1024 * 1024
    # Seconds a native connection may send nothing (the SDK pings every 15 s) before the
    # gateway closes it and its flows' partitions go to the rebalance delay; 0 = never.
    native_idle_timeout: float = 60.0
    log_level: str = "INFO"
    log_json: bool = False
    name: str = "keygate"
    # Limits (docs/operations.md, "Connection limits"): what one client can make the gateway hold.
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_user: int = DEFAULT_MAX_CONNECTIONS_PER_USER
    # The admin HTTP port's own cap (http and http_tls together, a standby's too), apart
    # from max_connections: neither side can take the other's connections. Its request
    # head is due within login_timeout, a request's body within http_body_timeout.
    max_http_connections: int = 256
    http_body_timeout: float = 30.0
    # Groups a queue may have for a bind to create another (each is permanent and holds
    # back the queue's retention); an admin's `keygate group create` may go beyond it.
    # 0 = no limit.
    max_groups_per_queue: int = 1000
    login_timeout: float = DEFAULT_LOGIN_TIMEOUT
    max_login_frame: int = DEFAULT_MAX_LOGIN_FRAME
    max_unconfirmed_bytes: int = DEFAULT_MAX_UNCONFIRMED_BYTES

    def connection_limits(self) -> ConnectionLimits:
        """The bounds every listener enforces, with one connection counter for them all."""
        return ConnectionLimits(
            login_timeout=self.login_timeout,
            max_login_frame=self.max_login_frame,
            max_unconfirmed_bytes=self.max_unconfirmed_bytes,
            connections=ConnectionCounter(self.max_connections, self.max_connections_per_user),
        )

    def port(self, listener: str) -> int | None:
        return self.ports.get(listener)

    def permission(self, username: str | None) -> Permission:
        if not self.users:
            return FULL_PERMISSION
        return self.permissions.get(username or "", Permission())


def parse_port(listener: str, value: object, source: str | None = None) -> int | None:
    """A port: an int 0-65535 (0 = any free port), or ``off``/None (listener off)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "off"):
        return None
    port: object = value
    if isinstance(value, str):
        try:
            port = int(value.strip())
        except ValueError:
            port = None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise bad(
            f"{listener} port",
            source or f"KEYGATE_{listener.upper()}_PORT",
            repr(value),
            "a port 0-65535 (0 = any free port) or 'off'",
        )
    return port


_TABLES: Final = ("ports", "users", "permissions", "certificate_users")
# Overrides the serve command takes as flags; any other override comes from a program.
_FLAGS: Final = frozenset(("db", "host", "ports_file"))


def load_config(
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> GatewayConfig:
    """Build the configuration from a TOML file, ``KEYGATE_*`` variables and overrides.

    TOML layout: top-level scalars (``db``, ``host``, ...), a ``[ports]`` table, a
    ``[users]`` table of name = password hash, ``[permissions.NAME]`` tables with
    ``publish`` / ``consume`` / ``monitor`` glob lists and ``admin``, and a
    ``[certificate_users]`` table of certificate CN = user. Environment: ``KEYGATE_DB``,
    ``KEYGATE_NATIVE_PORT``, ``KEYGATE_MQTT_TLS_PORT`` (etc.),
    ``KEYGATE_USERS=alice:HASH,bob:HASH``. Every value is checked by the settings table
    (``gateway.settings``); a bad one raises ``ConfigError``, naming where it came from.
    """
    values: dict[str, Any] = {}
    ports: dict[str, int | None] = dict(DEFAULT_PORTS)
    users: dict[str, str] = {}
    permissions: dict[str, Permission] = {}
    certificate_users: dict[str, str] = {}
    if file is not None:
        try:
            data = tomllib.loads(Path(file).read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config file {file}: {e}") from e
        for key, value in data.items():
            where = f"{file}:{key}"
            if key == "ports":
                for name, port in _table(key, where, value, "a table of listener = port").items():
                    _check_listener(name, f"{where}.{name}")
                    ports[name] = parse_port(name, port, f"{where}.{name}")
            elif key == "users":
                users.update(_names(key, where, value, "password hash"))
            elif key == "permissions":
                entries = _table(key, where, value, "a table of [permissions.USER] tables")
                for user, entry in entries.items():
                    permissions[user] = parse_permission(user, entry, f"{where}.{user}")
            elif key == "certificate_users":
                certificate_users.update(_names(key, where, value, "user name"))
            elif key in BY_NAME:
                values[key] = BY_NAME[key].parse(value, where, text=False)
            else:
                raise ConfigError(f"unknown setting {key!r} in {file}")
    environ = os.environ if env is None else env
    for name in LISTENERS:
        variable = f"KEYGATE_{name.upper()}_PORT"
        if (raw := environ.get(variable)) is not None:
            ports[name] = parse_port(name, raw, variable)
    for setting in SETTINGS:
        if (raw := environ.get(setting.env)) is not None:
            values[setting.name] = setting.parse(raw, setting.env, text=True)
    if raw_users := environ.get("KEYGATE_USERS"):  # empty: no users, as if unset
        users.update(_env_users(raw_users))
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if key.endswith("_port"):
            listener = key.removesuffix("_port")
            _check_listener(listener, flag)
            ports[listener] = parse_port(listener, value, flag)
        elif key in BY_NAME:
            source = flag if key in _FLAGS else f"override {key}"
            values[key] = BY_NAME[key].parse(value, source, text=isinstance(value, str))
        elif key == "users":
            users.update(_names(key, f"override {key}", value, "password hash"))
        elif key == "permissions":
            for user, entry in _table(key, f"override {key}", value, "a table").items():
                permissions[user] = (
                    entry
                    if isinstance(entry, Permission)
                    else parse_permission(user, entry, f"override {key}.{user}")
                )
        elif key == "certificate_users":
            certificate_users.update(_names(key, f"override {key}", value, "user name"))
        else:
            raise ConfigError(f"unknown setting {key!r}")
    return replace(
        GatewayConfig(),
        ports=ports,
        users=users,
        permissions=permissions,
        certificate_users=certificate_users,
        **values,
    )


def _table(name: str, source: str, value: object, expected: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise bad(name, source, repr(value), expected)
    return value


def _names(name: str, source: str, value: object, what: str) -> dict[str, str]:
    """A table of name = string (``[users]``: password hashes, ``[certificate_users]``).
    A value that is not a string is named by its type only: it may be a password."""
    table = _table(name, source, value, f"a table of name = {what}")
    for key, item in table.items():
        if not isinstance(item, str):
            raise bad(f"{name}.{key}", f"{source}.{key}", f"<{type(item).__name__}>", what)
    return dict(table)


def _env_users(raw: str) -> dict[str, str]:
    """``KEYGATE_USERS=alice:HASH,bob:HASH``. The value holds passwords (or their hashes):
    an error names the entry by position, never by its text."""
    users: dict[str, str] = {}
    entries = raw.split(",")
    for number, pair in enumerate(entries, 1):
        user, sep, password = pair.partition(":")
        if not sep or not user.strip():
            raise bad(
                "users",
                "KEYGATE_USERS",
                f"entry {number} of {len(entries)} (not shown: it may hold a password)",
                "a comma list of user:password-hash",
            )
        users[user.strip()] = password
    return users


def parse_permission(user: str, entry: object, source: str | None = None) -> Permission:
    """A ``[permissions.USER]`` table; a missing key grants nothing."""
    name = f"permissions.{user}"
    where = source or name
    table = _table(name, where, entry, "a table of publish, consume, monitor, admin")
    unknown = set(table) - _PERMISSION_KEYS
    if unknown:
        raise bad(
            name,
            where,
            repr(dict(table)),
            f"unknown permission {', '.join(sorted(unknown))}: the keys are "
            f"{', '.join(sorted(_PERMISSION_KEYS))}",
        )
    lists = {}
    for action in ("publish", "consume", "monitor"):
        patterns = table.get(action, ())
        if isinstance(patterns, str) or not (
            isinstance(patterns, list | tuple) and all(isinstance(p, str) for p in patterns)
        ):
            raise bad(
                f"{name}.{action}", f"{where}.{action}", repr(patterns), "a list of queue globs"
            )
        lists[action] = tuple(patterns)
    admin = table.get("admin", False)
    if not isinstance(admin, bool):
        raise bad(f"{name}.admin", f"{where}.admin", repr(admin), "true or false")
    return Permission(lists["publish"], lists["consume"], lists["monitor"], admin)


def _check_listener(name: str, source: str) -> None:
    if name not in LISTENERS:
        raise bad("ports", source, repr(name), f"a listener: one of {', '.join(LISTENERS)}")


def settings_reference() -> str:
    """docs/operations.md's settings reference: a Markdown table rendered from the
    settings table, so the documented types and ranges are the ones enforced."""
    defaults = GatewayConfig()
    rows = [
        "| setting | environment | default | accepted values | what it does |",
        "|---|---|---|---|---|",
    ]
    for setting in SETTINGS:
        default = getattr(defaults, setting.name)
        shown = "unset" if default is None else f"`{json.dumps(default)}`"
        rows.append(
            f"| `{setting.name}` | `{setting.env}` | {shown} | {setting.expected} | "
            f"{setting.help} |"
        )
    return "\n".join(rows) + "\n"
