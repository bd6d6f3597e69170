"""STOMP frames and the versions keygate speaks (the protocol errors: errors.py).

A ``Frame`` is what travels on the wire in either direction: a command, its headers in
wire order (repeated keys allowed, the first one wins, STOMP 1.2 §"Repeated Header
Entries") and a body of bytes.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from core.frozen import frozen


class Version(StrEnum):
    V1_0 = "1.0"
    V1_1 = "1.1"
    V1_2 = "1.2"


SUPPORTED_VERSIONS: Final = (Version.V1_0, Version.V1_1, Version.V1_2)

# Frames whose headers are never escaped, whatever the version (STOMP 1.2 "Value Encoding").
UNESCAPED_COMMANDS: Final = frozenset({"CONNECT", "STOMP", "CONNECTED"})


@frozen
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


__all__ = ["SUPPORTED_VERSIONS", "UNESCAPED_COMMANDS", "Frame", "Version"]
