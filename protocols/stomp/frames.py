"""STOMP frames, the versions keygate speaks, and the STOMP protocol errors.

A ``Frame`` is what travels on the wire in either direction: a command, its headers in
wire order (repeated keys allowed, the first one wins, STOMP 1.2 §"Repeated Header
Entries") and a body of bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar, Final

from core.errors import ProtocolError


class Version(StrEnum):
    V1_0 = "1.0"
    V1_1 = "1.1"
    V1_2 = "1.2"


SUPPORTED_VERSIONS: Final = (Version.V1_0, Version.V1_1, Version.V1_2)

# Frames whose headers are never escaped, whatever the version (STOMP 1.2 "Value Encoding").
UNESCAPED_COMMANDS: Final = frozenset({"CONNECT", "STOMP", "CONNECTED"})


@dataclass(frozen=True, slots=True)
class Frame:
    """One STOMP frame. ``headers`` keeps wire order; ``header()`` returns the first one."""

    command: str
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def header_map(self) -> dict[str, str]:
        """Every header once, first occurrence winning."""
        return dict(reversed(self.headers))


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
