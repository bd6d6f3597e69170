"""STOMP protocol errors, and what an ERROR frame says for each gateway error.

A codec or state-machine failure is raised as a ``StompProtocolError`` carrying the
``receipt-id`` the ERROR frame must echo and its short ``message`` header; any other
``KeygateError`` (a refused publish, a failed login) is answered with the fixed text
``error_message`` maps it to, never with its details (those go in the body).
"""

from __future__ import annotations

from typing import ClassVar, Final

from core.errors import (
    AuthenticationFailed,
    AuthError,
    KeygateError,
    MessageTooLarge,
    NoRoute,
    NotFound,
    PermissionDenied,
    ProtocolError,
    QueueFull,
    StorageError,
    Unavailable,
)


class StompProtocolError(ProtocolError):
    """Bad STOMP input. ``stomp_message`` becomes the ERROR frame's ``message`` header."""

    code = "stomp-protocol-error"
    stomp_message: ClassVar[str] = "malformed frame"

    def __init__(
        self,
        message: str,
        *,
        receipt_id: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message)
        self.receipt_id = receipt_id
        self.headers = headers


class FrameTooLarge(StompProtocolError):
    """A frame over ``max_frame_size`` or with more than ``max_headers`` headers."""

    code = "stomp-frame-too-large"
    stomp_message = "frame too large"


class UnsupportedVersion(StompProtocolError):
    """No version of ``accept-version`` is one keygate speaks."""

    code = "stomp-unsupported-version"
    stomp_message = "supported protocol versions are 1.0,1.1,1.2"


class InvalidFrame(StompProtocolError):
    """A well-formed frame with a missing or invalid header, or one out of place."""

    code = "stomp-invalid-frame"
    stomp_message = "invalid frame"


class TransactionTooLarge(StompProtocolError):
    """A transaction buffering more than the connection allows before COMMIT."""

    code = "stomp-transaction-too-large"
    stomp_message = "transaction too large"


class InvalidDestination(InvalidFrame):
    """A SEND destination that is neither ``/queue/NAME`` nor ``/topic/a.b.c``."""

    code = "stomp-invalid-destination"
    stomp_message = "unknown destination"


# The ERROR frame's short ``message`` header for each gateway error, first match wins.
_ERROR_MESSAGES: Final[tuple[tuple[type[KeygateError], str], ...]] = (
    (NoRoute, "unknown destination"),
    (NotFound, "unknown destination"),
    (AuthenticationFailed, "authentication failed"),
    (PermissionDenied, "not authorized"),
    (AuthError, "not authorized"),
    (MessageTooLarge, "message too large"),
    (QueueFull, "queue full"),
    (StorageError, "storage failure"),
    (Unavailable, "server unavailable"),
)


def error_message(error: KeygateError) -> str:
    """The ERROR frame's ``message`` header for ``error``."""
    if isinstance(error, StompProtocolError):
        return error.stomp_message
    return next((text for cls, text in _ERROR_MESSAGES if isinstance(error, cls)), "rejected")


__all__ = [
    "FrameTooLarge",
    "InvalidDestination",
    "InvalidFrame",
    "StompProtocolError",
    "TransactionTooLarge",
    "UnsupportedVersion",
    "error_message",
]
