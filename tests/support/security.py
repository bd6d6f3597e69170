"""Users for tests: password hashes in the stored format, at a low scrypt cost (the
format carries its parameters, so the gateway checks them at that cost), made once."""

from __future__ import annotations

import functools
import ipaddress
import socket
from typing import Final

from gateway.config import FULL_PERMISSION
from gateway.security import hash_password

# Everything, as an operator grants it to an administrator.
ADMIN: Final = FULL_PERMISSION


@functools.cache
def password_hash(password: str) -> str:
    return hash_password(password, n=16, r=1, p=1)


def hashed_users(**passwords: str) -> dict[str, str]:
    """``[users]`` for ``name=password`` pairs, as hashes."""
    return {name: password_hash(password) for name, password in passwords.items()}


def non_loopback_address() -> str | None:
    """An address of this host that is not loopback (a connection to it is seen by the
    listener as coming from it), or None when the host has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # UDP: picks the outgoing address, sends nothing
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if ipaddress.ip_address(address).is_loopback else address


__all__ = ["ADMIN", "hashed_users", "non_loopback_address", "password_hash"]
