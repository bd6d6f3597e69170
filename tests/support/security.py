"""Users for tests: password hashes in the stored format, at a low scrypt cost (the
format carries its parameters, so the gateway checks them at that cost), made once."""

from __future__ import annotations

import functools
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


__all__ = ["ADMIN", "hashed_users", "password_hash"]
