"""Client-side errors, and turning an ERROR frame's code back into keygate's error class."""

from __future__ import annotations

from core.errors import KeygateError


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


def _codes() -> dict[str, type[KeygateError]]:
    # Walked on each call (errors are rare): every imported subclass, including the
    # native protocol's, is found without a registry to keep in sync.
    found: dict[str, type[KeygateError]] = {}
    pending: list[type[KeygateError]] = [KeygateError]
    while pending:
        cls = pending.pop()
        # Parents are visited first, so a subclass re-using its parent's code never wins.
        found.setdefault(cls.code, cls)
        pending.extend(cls.__subclasses__())
    return found


def error_from_code(code: str, text: str) -> KeygateError:
    """The exception for an ERROR frame: the class registered for ``code`` (an unknown code
    gives a plain KeygateError), carrying ``text`` as its message and ``code``."""
    cls = _codes().get(code, KeygateError)
    # Subclasses such as QueueNotFound take structured arguments; the wire only has text.
    error = cls.__new__(cls)
    Exception.__init__(error, text)
    error.message = text
    if cls is KeygateError and code != KeygateError.code:
        error.args = (f"[{code}] {text}",)
    return error


__all__ = [
    "ClientClosed",
    "ClientError",
    "ConnectionLost",
    "ConsumerClosed",
    "error_from_code",
]
