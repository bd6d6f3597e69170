"""The native protocol's errors, and the map between keygate's error tree and the wire.

ERROR and FLOW_CLOSED carry the stable ``code`` of a ``KeygateError`` (core/errors.py)
and its message as text (docs/native-protocol.md §6): ``error_frame`` makes the frame for
an error, ``error_from_code`` turns a received code back into the class that has it (an
unknown code gives a plain KeygateError). The classes below are the native protocol's own
codes: bad framing, and a connection closed for silence.
"""

from __future__ import annotations

from core.errors import KeygateError, ProtocolError
from protocols.native.events import Error


class NativeProtocolError(ProtocolError):
    """Malformed, oversized or out-of-order native frame. ``code`` goes into ERROR frames."""

    code = "protocol-error"


class FrameTooLarge(NativeProtocolError):
    code = "frame-too-large"


class UnsupportedVersion(NativeProtocolError):
    code = "unsupported-version"


class LoginTimeout(NativeProtocolError):
    """No HELLO arrived within the server's login timeout."""

    code = "login-timeout"


class IdleTimeout(NativeProtocolError):
    """A logged-in connection sent no frame for the server's idle timeout."""

    code = "idle-timeout"


def error_frame(error: KeygateError, request_id: int = 0) -> Error:
    """The ERROR frame for ``error``: answering ``request_id``, or ending the connection
    (id 0)."""
    return Error(request_id=request_id, code=error.code, text=error.message)


def _codes() -> dict[str, type[KeygateError]]:
    # Walked on each call (errors are rare): every imported subclass, including the
    # protocols' and the SDK's, is found without a registry to keep in sync.
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
    "FrameTooLarge",
    "IdleTimeout",
    "LoginTimeout",
    "NativeProtocolError",
    "UnsupportedVersion",
    "error_frame",
    "error_from_code",
]
