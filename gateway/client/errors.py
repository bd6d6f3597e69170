"""Client-side errors. ``error_from_code`` (an ERROR frame's code back to keygate's error
class) lives with the protocol, in protocols/native/errors.py."""

from __future__ import annotations

from core.errors import KeygateError
from protocols.native.errors import error_from_code


class ClientError(KeygateError):
    """Base of the errors the SDK raises on its own (not sent by the gateway)."""

    code = "client-error"


class ConnectionLost(ClientError, ConnectionError):
    """The connection dropped while a request was in flight; its outcome is unknown.

    A publish that fails with this may or may not have been stored: it is not resent
    automatically unless it carries a ``dedup_id`` (then a queue with a dedup window drops
    the copy).
    """

    code = "connection-lost"


class ClientClosed(ClientError):
    """The client or consumer was closed (or gave up reconnecting)."""

    code = "client-closed"


class ConsumerClosed(ClientClosed):
    code = "consumer-closed"


__all__ = [
    "ClientClosed",
    "ClientError",
    "ConnectionLost",
    "ConsumerClosed",
    "error_from_code",
]
