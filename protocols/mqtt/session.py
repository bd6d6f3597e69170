"""MQTT sessions kept in memory by one listener, keyed by client id.

The only server-side session state an inbound-only broker needs is the set of QoS 2
packet ids whose PUBLISH has been committed but whose PUBREL has not arrived yet: it is
what makes QoS 2 exactly-once across a reconnect (a re-sent PUBLISH with DUP is answered
with PUBREC and not stored again). A session outlives its connection for its Session
Expiry Interval (MQTT 5) or, for an MQTT 3.1.1 client with clean session 0, for the
listener's ``max_session_expiry``. Expired sessions are dropped lazily. Time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class Session:
    client_id: str
    # The user who opened it: only that user may resume or take it over.
    owner: str | None = None
    # QoS 2 packet ids stored and PUBREC'd, waiting for PUBREL (§4.3.3 method B).
    qos2_received: set[int] = field(default_factory=set)
    # Seconds the session outlives a disconnect; None while connected means "decided then".
    expiry_interval: float = 0.0
    expires_at: float | None = None


class SessionStore:
    """Sessions of one listener. Not thread-safe: used from the listener's event loop."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def owner(self, client_id: str, now: float) -> str | None:
        """The user of a live session of ``client_id`` (None: no session, or anonymous)."""
        self._expire(now)
        session = self._sessions.get(client_id)
        return None if session is None else session.owner

    def open(
        self, client_id: str, clean_start: bool, now: float, *, owner: str | None = None
    ) -> tuple[Session, bool]:
        """The session for a new connection and whether an existing one was resumed."""
        self._expire(now)
        existing = self._sessions.get(client_id)
        if existing is not None and not clean_start:
            existing.expires_at = None
            return existing, True
        session = Session(client_id, owner)
        self._sessions[client_id] = session
        return session, False

    def release(self, session: Session, now: float) -> None:
        """The session's connection ended: keep it for its expiry interval, or drop it."""
        if self._sessions.get(session.client_id) is not session:
            return  # already replaced by a newer connection's session
        if session.expiry_interval <= 0:
            del self._sessions[session.client_id]
        else:
            session.expires_at = now + session.expiry_interval

    def _expire(self, now: float) -> None:
        expired = [
            client_id
            for client_id, session in self._sessions.items()
            if session.expires_at is not None and session.expires_at <= now
        ]
        for client_id in expired:
            del self._sessions[client_id]
