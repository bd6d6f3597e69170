"""Connection negotiation pieces: what the server announces and how it reads SASL."""

from __future__ import annotations

import platform
import secrets
from typing import Any, Final

from pamqp import commands, decode

from protocols.amqp.constants import ReplyCode
from protocols.amqp.errors import AmqpConnectionError

PRODUCT: Final = "keygate"
CAPABILITIES: Final = {
    "publisher_confirms": True,
    "basic.nack": True,
    "consumer_cancel_notify": True,
    "connection.blocked": True,
    "exchange_exchange_bindings": False,
    "authentication_failure_close": True,
    "per_consumer_qos": True,
}


def server_named_queue() -> str:
    """A fresh queue name in RabbitMQ's style, within keygate's name alphabet."""
    return "amq.gen-" + secrets.token_urlsafe(16)


def credentials(mechanism: str, response: str | bytes) -> tuple[str | None, str | None]:
    """Username and password from a PLAIN, AMQPLAIN or EXTERNAL Start-Ok response.

    EXTERNAL (RabbitMQ's mechanism for TLS client certificates) carries no password: the
    certificate the TLS handshake verified names the user; a non-empty response is the
    user name the client asks to act as, which must be the certificate's."""
    raw = response.encode() if isinstance(response, str) else response
    if mechanism == "EXTERNAL":
        return (raw.decode("utf-8", "replace") or None), None
    if mechanism == "PLAIN":
        parts = raw.split(b"\x00")
        if len(parts) != 3:
            raise AmqpConnectionError(ReplyCode.ACCESS_REFUSED, "malformed PLAIN response")
        return parts[1].decode("utf-8", "replace"), parts[2].decode("utf-8", "replace")
    if mechanism == "AMQPLAIN":
        try:
            _, table = decode.field_table(len(raw).to_bytes(4, "big") + raw)
        except Exception as e:
            # pamqp's table decoder raises assorted stdlib errors on hostile input.
            raise AmqpConnectionError(
                ReplyCode.ACCESS_REFUSED, "malformed AMQPLAIN response"
            ) from e
        login, password = table.get("LOGIN"), table.get("PASSWORD")
        return _optional_str(login), _optional_str(password)
    raise AmqpConnectionError(ReplyCode.ACCESS_REFUSED, f"unsupported mechanism {mechanism!r}")


def _optional_str(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def server_properties() -> dict[str, Any]:
    return {
        "product": PRODUCT,
        "platform": f"Python {platform.python_version()}",
        "capabilities": dict(CAPABILITIES),
        "information": "keygate partitioned-queue gateway",
    }


def start_method() -> commands.Connection.Start:
    return commands.Connection.Start(0, 9, server_properties(), "PLAIN AMQPLAIN EXTERNAL", "en_US")


__all__ = [
    "CAPABILITIES",
    "PRODUCT",
    "credentials",
    "server_named_queue",
    "server_properties",
    "start_method",
]
