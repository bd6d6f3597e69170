"""Password hashes, the loopback rule, the login throttle and the start-up checks."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from core.errors import AuthenticationFailed, InvalidArgument, PermissionDenied
from gateway.config import GatewayConfig, Permission, load_config
from gateway.security import (
    USER_LIMIT,
    Authenticator,
    PasswordHash,
    check_security,
    hash_password,
    is_loopback,
)
from gateway.throttle import DEFAULT_HASHING, LoginThrottle, PasswordChecks
from protocols.sink import peer_identity
from tests.support.security import password_hash


def test_a_hash_carries_its_parameters_and_matches_only_its_password() -> None:
    stored = hash_password("s3cret", n=16, r=1, p=1)
    assert stored.startswith("scrypt$16$1$1$")
    parsed = PasswordHash.parse(stored)
    assert parsed.matches("s3cret")
    assert not parsed.matches("s3cret ")
    assert hash_password("s3cret", n=16, r=1, p=1) != stored  # salted


@pytest.mark.parametrize(
    "text",
    [
        "s3cret",
        "scrypt$16$1$1$AAAA",
        "scrypt$15$1$1$AAAA$AAAA",
        "scrypt$16$1$1$!!$AAAA",
        "bcrypt$x",
    ],
)
def test_anything_but_a_well_formed_scrypt_hash_is_not_a_hash(text: str) -> None:
    with pytest.raises(InvalidArgument):
        PasswordHash.parse(text)


@pytest.mark.parametrize(
    ("peer", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("192.0.2.2", False),
        ("10.0.0.1", False),
        ("::ffff:192.0.2.2", False),
        ("fd00::2", False),
        ("not-an-address", False),
        (None, False),
    ],
)
def test_loopback_is_decided_by_the_peer_address(peer: str | None, loopback: bool) -> None:
    assert is_loopback(peer) is loopback


def test_the_throttle_blocks_an_address_for_growing_times_after_five_failures() -> None:
    throttle = LoginThrottle()
    for t in range(5):
        throttle.check("192.0.2.9", float(t))
        throttle.failed("192.0.2.9", float(t))
    with pytest.raises(AuthenticationFailed, match="too many failed logins"):
        throttle.check("192.0.2.9", 4.5)
    throttle.check("192.0.2.10", 4.5)  # other addresses are not affected
    throttle.check("192.0.2.9", 5.0)  # blocked for 1 s after the fifth failure
    throttle.failed("192.0.2.9", 5.0)
    with pytest.raises(AuthenticationFailed):
        throttle.check("192.0.2.9", 6.5)  # the sixth blocks for 2 s
    throttle.check("192.0.2.9", 7.0)


def test_failures_older_than_the_window_are_forgotten() -> None:
    throttle = LoginThrottle()
    for t in range(4):
        throttle.failed("192.0.2.9", float(t))
    throttle.failed("192.0.2.9", 100.0)
    throttle.check("192.0.2.9", 100.0)


def _authenticator(
    users: dict[str, str],
    *,
    certificate_users: dict[str, str] | None = None,
    allow_anonymous: bool = False,
) -> Authenticator:
    return Authenticator(
        users, certificate_users=certificate_users or {}, allow_anonymous=allow_anonymous
    )


async def test_without_users_anonymous_clients_are_admitted_from_loopback_only() -> None:
    auth = _authenticator({})
    assert await auth.authenticate(None, None, peer="127.0.0.1", certificate_user=None) is None
    with pytest.raises(PermissionDenied, match="loopback"):
        await auth.authenticate(None, None, peer="192.0.2.2", certificate_user=None)
    allowed = _authenticator({}, allow_anonymous=True)
    assert await allowed.authenticate(None, None, peer="192.0.2.2", certificate_user=None) is None


async def test_a_hashed_password_logs_in_and_anything_else_does_not() -> None:
    auth = _authenticator({"alice": password_hash("s3cret")})
    assert await auth.authenticate("alice", "s3cret", peer="::1", certificate_user=None) == "alice"
    for username, password in [("alice", "wrong"), ("bob", "s3cret"), (None, None)]:
        with pytest.raises(AuthenticationFailed):
            await auth.authenticate(username, password, peer="::1", certificate_user=None)


async def test_guesses_sent_in_parallel_are_throttled_like_guesses_in_a_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each guess used to be checked against the block before its hash and counted after
    it, so a burst sent at once was all checked and the right password, last, got in."""
    auth = _authenticator({"alice": password_hash("s3cret")})
    hashed = []
    matches = PasswordHash.matches

    def counting(self: PasswordHash, password: str) -> bool:
        hashed.append(password)
        return matches(self, password)

    monkeypatch.setattr(PasswordHash, "matches", counting)
    guesses = [f"guess-{i}" for i in range(40)] + ["s3cret"]
    outcomes = await asyncio.gather(
        *(
            auth.authenticate("alice", guess, peer="192.0.2.9", certificate_user=None)
            for guess in guesses
        ),
        return_exceptions=True,
    )
    assert isinstance(outcomes[-1], AuthenticationFailed)  # blocked by then
    assert len(hashed) < len(guesses)  # once blocked, the rest cost no hash
    # Another address is not affected.
    assert await auth.authenticate("alice", "s3cret", peer="192.0.2.10", certificate_user=None)


def _counting_hashes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The passwords hashed from now on, in order."""
    hashed: list[str] = []
    matches = PasswordHash.matches

    def counting(self: PasswordHash, password: str) -> bool:
        hashed.append(password)
        return matches(self, password)

    monkeypatch.setattr(PasswordHash, "matches", counting)
    return hashed


async def test_guesses_for_one_name_from_many_addresses_block_the_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """QA's flood: one guess from each of many addresses, each far under the address
    budget, was hashed and checked every time."""
    auth = _authenticator({"alice": password_hash("s3cret")})
    hashed = _counting_hashes(monkeypatch)
    refusals = []
    for i in range(40):
        with pytest.raises(AuthenticationFailed) as refused:
            await auth.authenticate(
                "alice", f"guess-{i}", peer=f"10.0.0.{i}", certificate_user=None
            )
        refusals.append(refused.value.message)
    assert refusals[:USER_LIMIT] == ["bad username or password"] * USER_LIMIT
    assert all("too many failed logins for user 'alice'" in r for r in refusals[USER_LIMIT:])
    assert len(hashed) == USER_LIMIT
    with pytest.raises(AuthenticationFailed, match="for user 'alice'"):  # right, but blocked
        await auth.authenticate("alice", "s3cret", peer="10.0.1.1", certificate_user=None)
    # Another name is not affected.
    with pytest.raises(AuthenticationFailed, match="bad username or password"):
        await auth.authenticate("bob", "guess", peer="10.0.1.2", certificate_user=None)


async def test_guesses_for_one_name_sent_in_parallel_from_many_addresses_are_throttled() -> None:
    auth = _authenticator({"alice": password_hash("s3cret")})
    auth.hashing = PasswordChecks(running=64, waiting=0)  # no guess is refused for it
    outcomes = await asyncio.gather(
        *(
            auth.authenticate("alice", f"guess-{i}", peer=f"10.0.0.{i}", certificate_user=None)
            for i in range(40)
        ),
        return_exceptions=True,
    )
    checked = [o for o in outcomes if "bad username" in str(o)]
    assert len(checked) <= USER_LIMIT
    assert all(isinstance(o, AuthenticationFailed) for o in outcomes)


async def test_the_names_block_spares_an_address_its_user_logged_in_from() -> None:
    """A flood against a name must not lock its clients out where they log in from; an
    attacker there is still held to the address's own budget."""
    auth = _authenticator({"alice": password_hash("s3cret")})
    assert await auth.authenticate("alice", "s3cret", peer="10.0.9.9", certificate_user=None)
    for i in range(USER_LIMIT + 5):
        with pytest.raises(AuthenticationFailed):
            await auth.authenticate("alice", "guess", peer=f"10.0.0.{i}", certificate_user=None)
    with pytest.raises(AuthenticationFailed, match="for user 'alice'"):
        await auth.authenticate("alice", "s3cret", peer="10.0.1.1", certificate_user=None)
    assert await auth.authenticate("alice", "s3cret", peer="10.0.9.9", certificate_user=None)
    for _ in range(5):
        with pytest.raises(AuthenticationFailed, match="bad username"):
            await auth.authenticate("alice", "guess", peer="10.0.9.9", certificate_user=None)
    with pytest.raises(AuthenticationFailed, match=r"from 10\.0\.9\.9"):
        await auth.authenticate("alice", "s3cret", peer="10.0.9.9", certificate_user=None)


async def test_hashes_at_once_are_bounded_and_the_excess_is_refused_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Guesses over many names from many addresses, each within its budgets, took a worker
    thread each: every core hashed and the event loop starved."""
    auth = _authenticator({"alice": password_hash("s3cret")})
    assert await auth.authenticate("alice", "s3cret", peer="::1", certificate_user=None)
    release = threading.Event()
    running: list[int] = []
    lock = threading.Lock()
    at_once = [0]

    def held(self: PasswordHash, password: str) -> bool:
        with lock:
            at_once[0] += 1
            running.append(at_once[0])
        release.wait(10)
        with lock:
            at_once[0] -= 1
        return False

    monkeypatch.setattr(PasswordHash, "matches", held)
    checks = auth.hashing
    guesses = [
        asyncio.create_task(
            auth.authenticate(f"user-{i}", "guess", peer=f"10.0.0.{i}", certificate_user=None)
        )
        for i in range(checks.limit + 10)
    ]
    try:
        await asyncio.wait(guesses, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(0)  # let every guess reach the hashing
        refused = [t for t in guesses if t.done()]
        assert len(refused) == 10
        for task in refused:
            with pytest.raises(AuthenticationFailed, match="too many logins being checked"):
                task.result()
        # A login whose password was checked recently needs no hash and gets in.
        assert await auth.authenticate("alice", "s3cret", peer="::1", certificate_user=None)
    finally:
        release.set()
        await asyncio.gather(*guesses, return_exceptions=True)
    assert max(running) <= DEFAULT_HASHING
    assert checks.held == 0


async def test_a_request_without_credentials_is_not_a_failed_login() -> None:
    """A browser's first console request carries none: five of them blocked the address."""
    auth = _authenticator({"alice": password_hash("s3cret")})
    for _ in range(10):
        with pytest.raises(AuthenticationFailed, match="required"):
            await auth.authenticate(None, None, peer="192.0.2.11", certificate_user=None)
    assert await auth.authenticate("alice", "s3cret", peer="192.0.2.11", certificate_user=None)


async def test_a_certificate_names_its_user_directly_or_through_the_mapping() -> None:
    auth = _authenticator(
        {"alice": password_hash("s3cret")}, certificate_users={"device-17": "alice"}
    )
    for cn in ("alice", "device-17"):
        assert await auth.authenticate(None, None, peer="::1", certificate_user=cn) == "alice"
    with pytest.raises(AuthenticationFailed):
        await auth.authenticate(None, None, peer="::1", certificate_user="mallory")
    with pytest.raises(AuthenticationFailed):  # the certificate is alice's, not bob's
        await auth.authenticate("bob", None, peer="::1", certificate_user="alice")


def test_plaintext_passwords_are_refused_at_start_unless_allowed() -> None:
    with pytest.raises(InvalidArgument, match="keygate passwd"):
        check_security(GatewayConfig(users={"alice": "s3cret"}))
    check_security(GatewayConfig(users={"alice": "s3cret"}, allow_plaintext_passwords=True))
    check_security(GatewayConfig(users={"alice": password_hash("s3cret")}))
    with pytest.raises(InvalidArgument, match="alice"):
        check_security(GatewayConfig(users={"alice": "scrypt$1$1$1$AA$AA"}))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tls_ca": "ca.pem"}, "needs tls_cert"),
        ({"tls_cert": "c.pem", "tls_require_client_cert": True}, "needs tls_ca"),
        ({"certificate_users": {"meter-1": "nobody"}}, "unknown users: nobody"),
    ],
)
def test_an_incomplete_certificate_setup_is_refused_at_start(
    settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        check_security(GatewayConfig(**settings))


def test_allow_anonymous_is_logged_as_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    check_security(GatewayConfig(allow_anonymous=True))
    assert "allow_anonymous" in caplog.text


def test_a_user_without_a_permissions_entry_has_no_right() -> None:
    config = GatewayConfig(users={"alice": password_hash("x")})
    nothing = config.permission("alice")
    assert not any(nothing.allows(a, "orders") for a in ("publish", "consume", "monitor"))
    assert not nothing.admin


def test_monitor_is_implied_by_consume_and_admin_but_grants_neither() -> None:
    assert Permission(consume=("orders",)).allows("monitor", "orders")
    assert Permission(admin=True).allows("monitor", "orders")
    watcher = Permission(monitor=("orders*",))
    assert watcher.allows("monitor", "orders.eu")
    assert not watcher.allows("consume", "orders.eu")
    assert not watcher.allows("publish", "orders.eu")


def test_a_permissions_table_grants_only_what_it_lists(tmp_path: Path) -> None:
    path = tmp_path / "keygate.toml"
    path.write_text('[permissions.bob]\npublish = ["public-*"]\n')
    bob = load_config(path, env={}).permissions["bob"]
    assert bob == Permission(publish=("public-*",))
    path.write_text('[permissions.bob]\nwrite = ["x"]\n')
    with pytest.raises(InvalidArgument, match="unknown permission write"):
        load_config(path, env={})


async def test_a_successful_check_is_remembered_and_a_wrong_password_is_not() -> None:
    now = [0.0]
    auth = Authenticator(
        {"alice": password_hash("s3cret")},
        certificate_users={},
        allow_anonymous=False,
        clock=lambda: now[0],
    )
    calls: list[str] = []
    real = PasswordHash.matches

    def counting(self: PasswordHash, password: str) -> bool:
        calls.append(password)
        return real(self, password)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PasswordHash, "matches", counting)
        for _ in range(3):
            await auth.authenticate("alice", "s3cret", peer="::1", certificate_user=None)
        assert calls == ["s3cret"]  # one scrypt, then the memo
        with pytest.raises(AuthenticationFailed):
            await auth.authenticate("alice", "s3cret!", peer="::1", certificate_user=None)
        now[0] += 301.0  # the memo expires
        await auth.authenticate("alice", "s3cret", peer="::1", certificate_user=None)
        assert calls == ["s3cret", "s3cret!", "s3cret"]


class _Transport:
    def __init__(self, subject: tuple[tuple[tuple[str, str], ...], ...]) -> None:
        self._extra = {"peername": ("192.0.2.7", 5000), "peercert": {"subject": subject}}

    def get_extra_info(self, name: str) -> object:
        return self._extra.get(name)


def test_a_certificate_subject_with_two_common_names_names_no_user() -> None:
    """/CN=meter-0017/CN=admin, signed by the trusted CA, logged in as admin (the last CN)."""
    one = _Transport(((("countryName", "DE"),), (("commonName", "meter-0017"),)))
    two = _Transport(((("commonName", "meter-0017"),), (("commonName", "admin"),)))
    assert peer_identity(one) == ("192.0.2.7", "meter-0017")
    assert peer_identity(two) == ("192.0.2.7", None)
