"""The gateway settings table: one row per scalar ``GatewayConfig`` setting, with its type,
bounds and help text. ``gateway.config`` reads every value through it, whatever the
source (TOML file, ``KEYGATE_*`` environment, command-line flag), and docs/operations.md's
settings reference is rendered from it (``gateway.config.settings_reference``), so a
bound is written once.

How it works. A value arrives either typed (TOML, a program's overrides) or as text (the
environment, a flag). Text is converted the way the row's type says (booleans take
1/0, true/false, yes/no, on/off); a typed value must already have the row's type (a TOML
``1.5`` is not an integer, ``"maybe"`` not a boolean). Then bounds and choices are
checked. Anything else is a ``ConfigError`` naming the setting, where the value came
from, the value and what is expected: one line for the CLI to print (exit 2), before
anything is started.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from core.errors import InvalidArgument
from core.ingress import MAX_WINDOW
from core.settings import SettingType

TRUE_WORDS: Final = frozenset(("1", "true", "yes", "on"))
FALSE_WORDS: Final = frozenset(("0", "false", "no", "off"))
LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class ConfigError(InvalidArgument):
    """A setting with a bad value (or a configuration file that cannot be read): a usage
    error of ``keygate serve``, reported before anything starts."""


def bad(name: str, source: str, shown: str, expected: str) -> ConfigError:
    """The one-line error: ``bad setting NAME (SOURCE) = VALUE: expected WHAT``."""
    return ConfigError(f"bad setting {name} ({source}) = {shown}: expected {expected}")


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    kind: SettingType
    help: str
    unit: str = ""
    minimum: float | None = None
    exclusive: bool = False  # the minimum itself is refused (> rather than >=)
    maximum: int | None = None
    zero: str = ""  # what 0 means, where it is allowed and means something special
    choices: tuple[str, ...] = ()  # case-insensitive; the value is kept upper-case
    optional: bool = False  # an empty string means unset (None)
    listed: bool = False  # a list of non-empty strings: a TOML array, or comma-separated text

    @property
    def env(self) -> str:
        return "KEYGATE_" + self.name.upper()

    @property
    def expected(self) -> str:
        """What a good value is, as the error message and the docs say it."""
        if self.listed:
            return "a list of names (text: comma-separated)"
        if self.kind is bool:
            return "true or false (text: 1/0, true/false, yes/no, on/off)"
        if self.kind is str:
            if self.choices:
                return "one of " + ", ".join(self.choices)
            return "a string (empty = unset)" if self.optional else "a non-empty string"
        what = "an integer" if self.kind is int else "a number"
        if self.maximum is not None:
            what += f" between {self.minimum:g} and {self.maximum}"
        elif self.minimum is not None:
            what += f" {'>' if self.exclusive else '>='} {self.minimum:g}"
        notes = [n for n in (self.unit, f"0 = {self.zero}" if self.zero else "") if n]
        return what + (f" ({', '.join(notes)})" if notes else "")

    def parse(self, value: object, source: str, *, text: bool) -> object:
        """The checked value; ``text`` says the source is text (environment, flag)."""

        def refuse() -> ConfigError:
            return bad(self.name, source, repr(value), self.expected)

        if self.listed:
            return _names(value, text, refuse)
        if self.kind is bool:
            return _boolean(value, text, refuse)
        if self.kind is str:
            if not isinstance(value, str):
                raise refuse()
            if self.choices:
                if value.strip().upper() not in self.choices:
                    raise refuse()
                return value.strip().upper()
            if value == "":
                if self.optional:
                    return None
                raise refuse()
            return value
        number = _number(value, self.kind, text, refuse)
        low = self.minimum
        if low is not None and (number < low or (self.exclusive and number == low)):
            raise refuse()
        if self.maximum is not None and number > self.maximum:
            raise refuse()
        return number


def _boolean(value: object, text: bool, refuse: Callable[[], ConfigError]) -> bool:
    if isinstance(value, bool):
        return value
    if text and isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
    raise refuse()


def _names(value: object, text: bool, refuse: Callable[[], ConfigError]) -> tuple[str, ...]:
    if text and isinstance(value, str):
        value = [name.strip() for name in value.split(",") if name.strip()]
    if not isinstance(value, list | tuple):
        raise refuse()
    for name in value:
        if not isinstance(name, str) or not name or name != name.strip():
            raise refuse()
    return tuple(value)


def _number(
    value: object, kind: SettingType, text: bool, refuse: Callable[[], ConfigError]
) -> int | float:
    if isinstance(value, bool):  # bool is an int to Python, not to a reader of the file
        raise refuse()
    if text and isinstance(value, str):
        try:
            value = int(value.strip()) if kind is int else float(value.strip())
        except ValueError:
            raise refuse() from None
    if kind is int:
        if not isinstance(value, int):
            raise refuse()
        return value
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise refuse()
    return float(value)


def _seconds(name: str, help: str, *, zero: str = "") -> Setting:
    """A duration: positive, or (with ``zero``) 0 meaning something special."""
    return Setting(name, float, help, "seconds", minimum=0, exclusive=not zero, zero=zero)


def _count(name: str, help: str, unit: str = "", *, zero: str = "") -> Setting:
    """A size or count: at least 1, or (with ``zero``) 0 meaning no limit."""
    return Setting(name, int, help, unit, minimum=0 if zero else 1, zero=zero)


SETTINGS: Final = (
    Setting("db", str, "SQLAlchemy URL of the database"),
    Setting("host", str, "address the listeners bind (`::` = every IPv6 and IPv4 address)"),
    Setting("name", str, "the lease name shared by active/standby gateways"),
    Setting("ports_file", str, "write the bound ports here as JSON when ready",
            optional=True),
    Setting("log_level", str, "log level", choices=LOG_LEVELS),
    Setting("log_json", bool, "one JSON object per log line"),
    Setting("allow_anonymous", bool, "anonymous clients from any address, not only loopback"),
    Setting("http_allowed_hosts", str, "names the admin HTTP port answers anonymous "
            "requests under, beside localhost and IP addresses", listed=True),
    Setting("allow_plaintext_passwords", bool, "accept [users] passwords that are not hashes"),
    Setting("tls_cert", str, "certificate file: the TLS listeners start", optional=True),
    Setting("tls_key", str, "private key file of tls_cert", optional=True),
    Setting("tls_ca", str, "CA file: client certificates log users in", optional=True),
    Setting("tls_require_client_cert", bool, "refuse TLS clients without a certificate"),
    _seconds("lease_ttl", "active/standby lease: renewed every third of it, lost after it"),
    _seconds("ack_flush_interval", "acks are written at least this often"),
    _seconds("retention_interval", "a retention run starts this often"),
    _seconds("login_timeout", "time from accept to a completed login"),
    _seconds("http_body_timeout", "time to receive an admin HTTP request's body"),
    _seconds("native_idle_timeout", "a silent native connection is closed after it",
             zero="never"),
    _count("buffer_size", "unsent messages per (group, partition) in memory", "messages"),
    _count("group_buffer_bytes", "unsent message bytes per group in memory", "bytes"),
    _count("gateway_buffer_bytes", "unsent message bytes for all groups", "bytes"),
    Setting("max_window", int, "largest consumer window (larger ones are clamped)",
            "messages", minimum=1, maximum=MAX_WINDOW),
    _count("consumer_write_buffer", "bytes a consumer connection may have unsent", "bytes"),
    _count("max_connections", "connections in total", zero="no limit"),
    _count("max_connections_per_user", "logged-in connections of one user", zero="no limit"),
    _count("max_http_connections", "admin HTTP connections (http and http_tls together)",
           zero="no limit"),
    _count("max_groups_per_queue", "groups a bind may create per queue", zero="no limit"),
    _count("max_login_frame", "largest frame before login", "bytes"),
    _count("max_unconfirmed_bytes", "unconfirmed publish bytes per connection", "bytes"),
)  # fmt: skip

BY_NAME: Final = {s.name: s for s in SETTINGS}
