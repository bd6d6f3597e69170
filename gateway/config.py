"""Gateway configuration: defaults < TOML file < ``KEYGATE_*`` environment < CLI flags.

A port is an int (0 = any free port) or ``None`` (listener off; spelt ``off`` in files,
environment and flags).
"""

from __future__ import annotations

import fnmatch
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Final

from core.errors import InvalidArgument
from protocols._limits import (
    DEFAULT_LOGIN_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_USER,
    DEFAULT_MAX_LOGIN_FRAME,
    DEFAULT_MAX_UNCONFIRMED_BYTES,
    ConnectionCounter,
    ConnectionLimits,
)

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


def parse_port(listener: str, value: object) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() == "off"):
        return None
    try:
        port = int(str(value))
    except ValueError:
        raise InvalidArgument(f"{listener} port must be a number or 'off', got {value!r}") from None
    if not 0 <= port <= 65535:
        raise InvalidArgument(f"{listener} port must be 0-65535, got {port}")
    return port


_TABLES: Final = ("ports", "users", "permissions", "certificate_users")
_SCALARS: Final = {f.name: f for f in fields(GatewayConfig) if f.name not in _TABLES}


def _coerce(name: str, value: Any) -> Any:
    default = getattr(GatewayConfig(), name)
    if isinstance(default, bool):
        return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
    if isinstance(default, float):
        return float(value)
    if isinstance(default, int):
        return int(value)
    return None if value in ("", None) else str(value)


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
    ``KEYGATE_USERS=alice:HASH,bob:HASH``.
    """
    values: dict[str, Any] = {}
    ports: dict[str, int | None] = dict(DEFAULT_PORTS)
    users: dict[str, str] = {}
    permissions: dict[str, Permission] = {}
    certificate_users: dict[str, str] = {}
    if file is not None:
        try:
            data = tomllib.loads(Path(file).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise InvalidArgument(f"cannot read config file {file}: {e}") from e
        for key, value in data.items():
            if key == "ports":
                for name, port in value.items():
                    _check_listener(name)
                    ports[name] = parse_port(name, port)
            elif key == "users":
                users.update({str(k): str(v) for k, v in value.items()})
            elif key == "permissions":
                permissions.update({str(u): parse_permission(u, p) for u, p in value.items()})
            elif key == "certificate_users":
                certificate_users.update({str(k): str(v) for k, v in value.items()})
            elif key in _SCALARS:
                values[key] = _coerce(key, value)
            else:
                raise InvalidArgument(f"unknown setting {key!r} in {file}")
    environ = os.environ if env is None else env
    for name in LISTENERS:
        if (raw := environ.get(f"KEYGATE_{name.upper()}_PORT")) is not None:
            ports[name] = parse_port(name, raw)
    for key in _SCALARS:
        if (raw := environ.get(f"KEYGATE_{key.upper()}")) is not None:
            values[key] = _coerce(key, raw)
    if raw_users := environ.get("KEYGATE_USERS"):
        for pair in raw_users.split(","):
            user, sep, password = pair.partition(":")
            if not sep:
                raise InvalidArgument("KEYGATE_USERS is a comma list of user:password-hash")
            users[user] = password
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key.endswith("_port"):
            listener = key.removesuffix("_port")
            _check_listener(listener)
            ports[listener] = parse_port(listener, value)
        elif key in _SCALARS:
            values[key] = _coerce(key, value)
        elif key == "users":
            users.update(value)
        elif key == "permissions":
            permissions.update(value)
        elif key == "certificate_users":
            certificate_users.update(value)
        else:
            raise InvalidArgument(f"unknown setting {key!r}")
    for key in ("buffer_size", "group_buffer_bytes", "gateway_buffer_bytes"):
        if key in values and values[key] < 1:
            raise InvalidArgument(f"{key} must be >= 1, got {values[key]}")
    return replace(
        GatewayConfig(),
        ports=ports,
        users=users,
        permissions=permissions,
        certificate_users=certificate_users,
        **values,
    )


def parse_permission(user: str, entry: Mapping[str, Any]) -> Permission:
    """A ``[permissions.USER]`` table; a missing key grants nothing."""
    unknown = set(entry) - _PERMISSION_KEYS
    if unknown:
        raise InvalidArgument(
            f"unknown permission {', '.join(sorted(unknown))} for {user!r}; "
            f"permissions are {', '.join(sorted(_PERMISSION_KEYS))}"
        )
    lists = {}
    for action in ("publish", "consume", "monitor"):
        patterns = entry.get(action, ())
        if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
            raise InvalidArgument(f"permissions.{user}.{action} must be a list of queue globs")
        lists[action] = tuple(patterns)
    admin = entry.get("admin", False)
    if not isinstance(admin, bool):
        raise InvalidArgument(f"permissions.{user}.admin must be true or false")
    return Permission(lists["publish"], lists["consume"], lists["monitor"], admin)


def _check_listener(name: str) -> None:
    if name not in LISTENERS:
        raise InvalidArgument(f"unknown listener {name!r}; listeners are {', '.join(LISTENERS)}")
