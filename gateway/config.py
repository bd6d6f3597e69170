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

LISTENERS: Final = ("native", "mqtt", "amqp", "stomp", "http")
DEFAULT_PORTS: Final = {"native": 55555, "mqtt": 1883, "amqp": 5672, "stomp": 61613, "http": 8080}
DEFAULT_DB: Final = "sqlite:///keygate.db"


@dataclass(frozen=True, slots=True)
class Permission:
    """Glob patterns of queue names a user may publish to / consume from, and whether the
    user may administer (create, change, delete) queues, groups and subscriptions."""

    publish: tuple[str, ...] = ("*",)
    consume: tuple[str, ...] = ("*",)
    admin: bool = True

    def allows(self, action: str, queue: str) -> bool:
        patterns = self.publish if action == "publish" else self.consume
        return any(fnmatch.fnmatchcase(queue, p) for p in patterns)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    db: str = DEFAULT_DB
    host: str = "0.0.0.0"
    ports: Mapping[str, int | None] = field(default_factory=lambda: dict(DEFAULT_PORTS))
    ports_file: str | None = None
    # Authentication: no users = anonymous access allowed.
    users: Mapping[str, str] = field(default_factory=dict)
    permissions: Mapping[str, Permission] = field(default_factory=dict)
    tls_cert: str | None = None
    tls_key: str | None = None
    ack_flush_interval: float = 0.05
    retention_interval: float = 5.0
    # Active/standby: gateways sharing a database elect one active through a lease in SQL.
    lease_ttl: float = 10.0
    buffer_size: int = 1000
    log_level: str = "INFO"
    log_json: bool = False
    name: str = "keygate"
    # Limits (docs/operations.md, "Limits"): what one client can make the gateway hold.
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_user: int = DEFAULT_MAX_CONNECTIONS_PER_USER
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
            return Permission()
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


_SCALARS: Final = {
    f.name: f for f in fields(GatewayConfig) if f.name not in ("ports", "users", "permissions")
}


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
    ``[users]`` table of name = password, and ``[permissions.NAME]`` tables with
    ``publish`` / ``consume`` glob lists. Environment: ``KEYGATE_DB``,
    ``KEYGATE_NATIVE_PORT`` (etc.), ``KEYGATE_USERS=alice:pw,bob:pw``.
    """
    values: dict[str, Any] = {}
    ports: dict[str, int | None] = dict(DEFAULT_PORTS)
    users: dict[str, str] = {}
    permissions: dict[str, Permission] = {}
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
                for user, perm in value.items():
                    permissions[user] = Permission(
                        tuple(perm.get("publish", ("*",))),
                        tuple(perm.get("consume", ("*",))),
                        bool(perm.get("admin", True)),
                    )
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
                raise InvalidArgument("KEYGATE_USERS is a comma list of user:password")
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
        else:
            raise InvalidArgument(f"unknown setting {key!r}")
    return replace(GatewayConfig(), ports=ports, users=users, permissions=permissions, **values)


def _check_listener(name: str) -> None:
    if name not in LISTENERS:
        raise InvalidArgument(f"unknown listener {name!r}; listeners are {', '.join(LISTENERS)}")
