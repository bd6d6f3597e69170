"""Who may connect: password hashes, the anonymous-from-loopback rule, client certificates
and the failed-login throttle.

How it works. ``Authenticator.authenticate`` is what ``Broker.authenticate`` runs for every
listener; it is given the peer address the listener saw and, on a TLS listener with a
verified client certificate, the certificate's subject CN. In order:

1. A peer address, or a user name, that failed too often recently is refused at once
   (``LoginThrottle``, gateway/throttle.py, which also says what bounds the hashing).
2. A verified client certificate names a user (``[certificate_users]`` maps a CN to a
   user; without an entry the CN is the user name); if that user is configured and the
   client gave no other user name, it is that user, without a password.
3. No users configured: anonymous access, from a loopback peer only unless
   ``allow_anonymous = true``.
4. Otherwise the user name and password are checked against the stored scrypt hash, in a
   worker thread (scrypt is deliberately slow; ``PasswordChecks`` bounds how many at
   once) and in constant time; an unknown user costs the same hash as a known one so
   timing does not tell which names exist. A successful
   check is remembered for ``VERIFIED_TTL`` seconds as an HMAC of (user, password) under a
   key that lives only in this process, so an HTTP client sending Basic credentials with
   every request, or a reconnect storm, does not cost one scrypt per request. The memo
   holds no password and nothing that outlives the process.

A stored password is ``scrypt$N$r$p$<salt b64>$<hash b64>``: the format carries its own
cost parameters, so stronger ones can be rolled out user by user.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import ipaddress
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from core.errors import AuthenticationFailed, InvalidArgument, PermissionDenied
from gateway.config import GatewayConfig
from gateway.throttle import LoginThrottle, PasswordChecks, TrustedAddresses

log = logging.getLogger("keygate.security")

SCHEME: Final = "scrypt"
# OWASP's scrypt minimum (N=2^17, r=8, p=1) costs ~128 MiB per check; 2^15 keeps a burst of
# logins inside a few hundred MiB while still costing an attacker ~32 MiB per guess.
DEFAULT_N: Final = 2**15
DEFAULT_R: Final = 8
DEFAULT_P: Final = 1
_SALT_BYTES: Final = 16
_HASH_BYTES: Final = 32
VERIFIED_TTL: Final = 300.0
_VERIFIED_MAX: Final = 4096
# Failed logins of one user name, from any address, before it is blocked: more than an
# address gets (5), since many clients may share a name.
USER_LIMIT: Final = 10


@dataclass(frozen=True, slots=True)
class PasswordHash:
    n: int
    r: int
    p: int
    salt: bytes
    digest: bytes

    @classmethod
    def parse(cls, text: str) -> PasswordHash:
        """Parse ``scrypt$N$r$p$salt$hash``; raise InvalidArgument when it is not one."""
        parts = text.split("$")
        if len(parts) != 6 or parts[0] != SCHEME:
            raise InvalidArgument("not a scrypt password hash (make one with `keygate passwd`)")
        try:
            n, r, p = int(parts[1]), int(parts[2]), int(parts[3])
            salt = base64.b64decode(parts[4], validate=True)
            digest = base64.b64decode(parts[5], validate=True)
        except (ValueError, binascii.Error) as e:
            raise InvalidArgument(f"malformed scrypt password hash: {e}") from e
        if n < 2 or n & (n - 1) or r < 1 or p < 1 or not salt or not digest:
            raise InvalidArgument("scrypt password hash has invalid parameters")
        return cls(n, r, p, salt, digest)

    def matches(self, password: str) -> bool:
        """Blocks for the length of one scrypt (tens of milliseconds at the defaults)."""
        candidate = _scrypt(password, self.salt, self.n, self.r, self.p, len(self.digest))
        return hmac.compare_digest(candidate, self.digest)


def _scrypt(password: str, salt: bytes, n: int, r: int, p: int, length: int) -> bytes:
    return hashlib.scrypt(
        password.encode(), salt=salt, n=n, r=r, p=p, dklen=length, maxmem=256 * n * r * p + 2**20
    )


def hash_password(
    password: str, *, n: int = DEFAULT_N, r: int = DEFAULT_R, p: int = DEFAULT_P
) -> str:
    """A new salted hash of ``password`` in the stored format."""
    salt = secrets.token_bytes(_SALT_BYTES)
    digest = _scrypt(password, salt, n, r, p, _HASH_BYTES)
    b64 = base64.b64encode
    return f"{SCHEME}${n}${r}${p}${b64(salt).decode()}${b64(digest).decode()}"


def is_password_hash(text: str) -> bool:
    return text.startswith(SCHEME + "$")


def is_loopback(peer: str | None) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4-mapped loopback; False for None or a non-IP."""
    if peer is None:
        return False
    try:
        address = ipaddress.ip_address(peer.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


# Compared against when the user does not exist, so an unknown name costs a full hash.
_DUMMY: Final = PasswordHash(DEFAULT_N, DEFAULT_R, DEFAULT_P, b"\0" * _SALT_BYTES, b"\0" * 32)


class Authenticator:
    """Checks credentials against the configured users (see the module docstring)."""

    def __init__(
        self,
        users: Mapping[str, str],
        *,
        certificate_users: Mapping[str, str],
        allow_anonymous: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._plain: dict[str, str] = {}
        self._hashes: dict[str, PasswordHash] = {}
        for name, stored in users.items():
            if is_password_hash(stored):
                self._hashes[name] = PasswordHash.parse(stored)
            else:
                self._plain[name] = stored
        self._certificate_users = dict(certificate_users)
        self._allow_anonymous = allow_anonymous
        self._clock = clock
        self.throttle = LoginThrottle()
        self.user_throttle = LoginThrottle(limit=USER_LIMIT, subject="for user {!r}")
        self.trusted = TrustedAddresses()
        self.hashing = PasswordChecks()
        self._memo_key = secrets.token_bytes(32)
        self._verified: OrderedDict[bytes, float] = OrderedDict()

    async def authenticate(
        self,
        username: str | None,
        password: str | None,
        *,
        peer: str | None,
        certificate_user: str | None,
    ) -> str | None:
        """The authenticated user name (None = anonymous); raise AuthenticationFailed or
        PermissionDenied."""
        self.throttle.check(peer, self._clock())
        configured = self._plain.keys() | self._hashes.keys()
        if certificate_user is not None:
            user = self._certificate_users.get(certificate_user, certificate_user)
            if user in configured and username in (None, "", user):
                return user
        if not configured:
            if self._allow_anonymous or is_loopback(peer):
                return username
            raise PermissionDenied(
                f"anonymous access is allowed from loopback only, not from {peer} "
                "(configure users, or set allow_anonymous = true)"
            )
        if not username and not password:
            # Nothing guessed (a browser's first request): refused, not a failed login.
            raise AuthenticationFailed("a user name and password are required")
        name = username or ""
        # The user name's block spares the addresses its user logs in from.
        by_name = None if self.trusted.trusts(name, peer, self._clock()) else self.user_throttle
        if by_name is not None:
            by_name.check(name, self._clock())

        def blocked() -> bool:
            now = self._clock()
            return self.throttle.blocked(peer, now) or (
                by_name is not None and by_name.blocked(name, now)
            )

        async with (
            self.throttle.checking(peer, self._clock),
            contextlib.nullcontext() if by_name is None else by_name.checking(name, self._clock),
        ):
            matched = await self._check(name, password or "", blocked)
            # Blocked meanwhile by guesses sent in parallel: refused, whatever the password.
            now = self._clock()
            self.throttle.check(peer, now)
            if by_name is not None:
                by_name.check(name, now)
            if matched:
                self.trusted.add(name, peer, now)
                return username
            self.throttle.failed(peer, now)
            self.user_throttle.failed(name, now)
        raise AuthenticationFailed("bad username or password")

    @staticmethod
    def _matches(expected: PasswordHash, password: str, blocked: Callable[[], bool]) -> bool:
        """On a worker thread: the hash, unless the address or name got blocked while this
        waited (a burst of guesses costs no more hashes once it is blocked)."""
        return not blocked() and expected.matches(password)

    async def _check(self, username: str, password: str, blocked: Callable[[], bool]) -> bool:
        plain = self._plain.get(username)
        if plain is not None:
            return hmac.compare_digest(plain.encode(), password.encode())
        stored = self._hashes.get(username)
        memo = hmac.digest(self._memo_key, f"{username}\0{password}".encode(), "sha256")
        now = self._clock()
        if stored is not None and self._verified.get(memo, 0.0) > now:
            self._verified.move_to_end(memo)
            return True
        expected = stored if stored is not None else _DUMMY
        # Off the event loop: one scrypt takes tens of milliseconds.
        async with self.hashing.slot():
            matched = await asyncio.to_thread(self._matches, expected, password, blocked)
        if matched and stored is not None:
            self._verified[memo] = now + VERIFIED_TTL
            self._verified.move_to_end(memo)
            if len(self._verified) > _VERIFIED_MAX:
                self._verified.popitem(last=False)
            return True
        return False


def check_security(config: GatewayConfig) -> None:
    """Refuse a configuration that would start insecure without saying so; warn about the
    insecure choices it makes explicitly. Raises InvalidArgument."""
    plain = sorted(name for name, stored in config.users.items() if not is_password_hash(stored))
    if plain and not config.allow_plaintext_passwords:
        raise InvalidArgument(
            f"users {', '.join(plain)} have plaintext passwords; store hashes made with "
            "`keygate passwd`, or set allow_plaintext_passwords = true"
        )
    for name, stored in config.users.items():
        if is_password_hash(stored):
            try:
                PasswordHash.parse(stored)
            except InvalidArgument as e:
                raise InvalidArgument(f"user {name!r}: {e.message}") from e
    if plain:
        log.warning("users %s have plaintext passwords (allow_plaintext_passwords)", plain)
    if config.allow_anonymous and not config.users:
        log.warning("allow_anonymous: any client from any address may do anything")
    if config.tls_ca and not config.tls_cert:
        raise InvalidArgument("tls_ca (client certificates) needs tls_cert and tls_key")
    if config.tls_require_client_cert and not config.tls_ca:
        raise InvalidArgument("tls_require_client_cert needs tls_ca, the CA clients are signed by")
    unknown = sorted(set(config.certificate_users.values()) - set(config.users))
    if unknown:
        raise InvalidArgument(f"certificate_users maps to unknown users: {', '.join(unknown)}")


__all__ = [
    "USER_LIMIT",
    "Authenticator",
    "PasswordHash",
    "check_security",
    "hash_password",
    "is_loopback",
    "is_password_hash",
]
