"""The sans-IO STOMP server connection: frames in, requests for the gateway out.

How it works (h11-style): ``receive_data`` feeds the codec; ``next_event`` turns the next
client frame into one of the events of ``protocols.stomp.events``, or buffers it (a SEND
inside a transaction), or raises a ``StompProtocolError`` carrying the ``receipt-id`` the
ERROR frame must echo. Which commands a state accepts is data (``_ACCEPTS``). The caller
answers with ``connected`` after authentication, ``receipt`` once the work a frame asked
for is committed, ``error`` for any failure (the connection is then closed, as STOMP says
after an ERROR frame); their frames accumulate in ``data_to_send()``, as the MQTT and AMQP
connections' do. ``HEARTBEAT`` is the idle line.

Transactions live here: BEGIN opens a buffer, transactional SENDs, ACKs and NACKs go into
it (an ACK or NACK must name an unacked delivery when it arrives), COMMIT hands the whole
buffer to the caller as one ``Commit``: the SENDs to store with ``Sink.publish_many`` (one
SQL transaction), the ACKs and NACKs resolved then, in order. ABORT and DISCONNECT drop
it: its deliveries stay unacked, for the client to ACK again.

Consuming: SUBSCRIBE, UNSUBSCRIBE, ACK and NACK become ``Subscribe``, ``Unsubscribe`` and
``Settle`` events through ``subscriptions`` (protocols.stomp.subscriptions); ``message``
encodes a delivery as a MESSAGE frame.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Final

from core.actions import Deliver
from core.errors import KeygateError
from core.model import Publication
from protocols._limits import DEFAULT_MAX_LOGIN_FRAME, parse_decimal
from protocols.stomp.codec import DEFAULT_MAX_FRAME_SIZE, DEFAULT_MAX_HEADERS, Codec
from protocols.stomp.errors import (
    InvalidFrame,
    StompProtocolError,
    TransactionTooLarge,
    UnsupportedVersion,
    error_message,
)
from protocols.stomp.events import (
    Commit,
    Connect,
    Disconnect,
    Event,
    Publish,
    ReceiptRequest,
)
from protocols.stomp.frames import SUPPORTED_VERSIONS, Frame, Version
from protocols.stomp.mapping import publication_from_send
from protocols.stomp.subscriptions import Subscriptions

HEARTBEAT: Final = b"\n"
MAX_OPEN_TRANSACTIONS: Final = 64
MAX_TRANSACTION_MESSAGES: Final = 10_000
MAX_TRANSACTION_BYTES: Final = 64 * 1024 * 1024
# A client is dropped after this many of its negotiated heart-beat intervals of silence
# (the spec leaves the margin to the implementation; stomp.py itself allows 1.5).
HEARTBEAT_TOLERANCE: Final = 2.0
# The longest heart-beat interval a client may ask for (one day, in milliseconds); a larger
# or malformed value is an ERROR, not an overflow in the reader.
MAX_HEARTBEAT: Final = 86_400_000


class State(Enum):
    AWAITING_CONNECT = "awaiting-connect"
    AUTHENTICATING = "authenticating"
    CONNECTED = "connected"
    CLOSED = "closed"


_CONSUMING: Final = frozenset({"SUBSCRIBE", "UNSUBSCRIBE", "ACK", "NACK"})
_ACCEPTS: Final = {
    State.AWAITING_CONNECT: frozenset({"CONNECT", "STOMP"}),
    State.AUTHENTICATING: frozenset[str](),
    State.CONNECTED: frozenset({"SEND", "BEGIN", "COMMIT", "ABORT", "DISCONNECT"}) | _CONSUMING,
    State.CLOSED: frozenset[str](),
}


def _negotiate(frame: Frame) -> Version:
    offered = frame.header("accept-version")
    if offered is None:
        return Version.V1_0
    versions = {v.strip() for v in offered.split(",")}
    for version in reversed(SUPPORTED_VERSIONS):
        if version.value in versions:
            return version
    raise UnsupportedVersion(
        f"none of the offered versions {offered!r} is supported",
        headers=(("version", ",".join(SUPPORTED_VERSIONS)),),
    )


def _heartbeat(frame: Frame, version: Version) -> tuple[int, int]:
    raw = frame.header("heart-beat")
    if raw is None or version is Version.V1_0:
        return 0, 0
    parts = [parse_decimal(p.strip(), MAX_HEARTBEAT) for p in raw.split(",")]
    if len(parts) != 2 or parts[0] is None or parts[1] is None:
        raise InvalidFrame(
            f"invalid heart-beat header {raw[:40]!r}: want 'cx,cy', each at most {MAX_HEARTBEAT} ms"
        )
    return parts[0], parts[1]


@dataclass(slots=True)
class _Transaction:
    publications: list[Publication] = field(default_factory=list)
    settles: list[Frame] = field(default_factory=list)  # ACK and NACK frames


class ServerConnection:
    """One client connection's protocol state. No I/O: see ``protocols.stomp.listener``."""

    def __init__(
        self,
        *,
        server: str = "keygate",
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        max_headers: int = DEFAULT_MAX_HEADERS,
        heartbeat: tuple[int, int] = (10_000, 10_000),
        max_login_frame: int = DEFAULT_MAX_LOGIN_FRAME,
    ) -> None:
        self.server = server
        self._max_frame_size = max_frame_size
        self.heartbeat = heartbeat
        self.state = State.AWAITING_CONNECT
        self.version = Version.V1_0
        # Until CONNECTED only a login-sized frame is read (a CONNECT is a few headers).
        self.codec = Codec(
            max_frame_size=min(max_login_frame, max_frame_size), max_headers=max_headers
        )
        self.producer = "stomp"
        # Seconds between our heart-beats / of client silence tolerated; None = off.
        self.send_interval: float | None = None
        self.receive_timeout: float | None = None
        self._client_heartbeat = (0, 0)
        self._client_id: str | None = None
        self._transactions: dict[str, _Transaction] = {}
        self._transaction_bytes = 0
        self.subscriptions = Subscriptions()
        self._out = bytearray()

    def receive_data(self, data: bytes) -> None:
        self.codec.receive_data(data)

    def data_to_send(self) -> bytes:
        """The frames produced since the last call, in order."""
        data = bytes(self._out)
        self._out.clear()
        return data

    def _send_frame(self, frame: Frame) -> None:
        self._out += self.codec.send(frame)

    def next_event(self) -> Event | None:
        """The next event, None when more bytes are needed, or a StompProtocolError."""
        while self.state in (State.AWAITING_CONNECT, State.CONNECTED):
            frame = self.codec.next_event()
            if frame is None:
                return None
            event = self._handle(frame)
            if event is not None:
                return event
        return None

    def _handle(self, frame: Frame) -> Event | None:
        receipt = frame.header("receipt")
        if frame.command not in _ACCEPTS[self.state]:
            raise InvalidFrame(
                f"{frame.command} frame not allowed in state {self.state.value!r}",
                receipt_id=receipt,
            )
        if frame.command == "SUBSCRIBE":
            return self.subscriptions.subscribe(frame)
        if frame.command == "UNSUBSCRIBE":
            return self.subscriptions.unsubscribe(frame)
        if frame.command in ("ACK", "NACK"):
            return self._settle(frame, receipt)
        if frame.command in ("CONNECT", "STOMP"):
            return self._connect(frame)
        if frame.command == "DISCONNECT":
            self.state = State.CLOSED
            self._drop_transactions()
            return Disconnect(receipt)
        if frame.command == "SEND":
            return self._send(frame, receipt)
        transaction = frame.header("transaction")
        if transaction is None:
            raise InvalidFrame(
                f"{frame.command} frame without a transaction header", receipt_id=receipt
            )
        if frame.command == "BEGIN":
            if transaction in self._transactions:
                raise InvalidFrame(f"transaction {transaction!r} already begun", receipt_id=receipt)
            if len(self._transactions) >= MAX_OPEN_TRANSACTIONS:
                raise TransactionTooLarge(
                    f"more than {MAX_OPEN_TRANSACTIONS} open transactions", receipt_id=receipt
                )
            self._transactions[transaction] = _Transaction()
            return ReceiptRequest(receipt) if receipt is not None else None
        ended = self._end_transaction(transaction, receipt)
        if frame.command == "COMMIT":
            settles = tuple(self.subscriptions.settle(f, self.version) for f in ended.settles)
            return Commit(transaction, tuple(ended.publications), receipt, settles)
        return ReceiptRequest(receipt) if receipt is not None else None

    def _settle(self, frame: Frame, receipt: str | None) -> Event | None:
        transaction = frame.header("transaction")
        if transaction is None:
            return self.subscriptions.settle(frame, self.version)
        self.subscriptions.check(frame, self.version)
        self._buffer(transaction, receipt).settles.append(frame)
        return ReceiptRequest(receipt) if receipt is not None else None

    def _buffer(self, transaction: str, receipt: str | None) -> _Transaction:
        """The open transaction a frame joins, with room for one more frame."""
        buffered = self._transactions.get(transaction)
        if buffered is None:
            raise InvalidFrame(f"unknown transaction {transaction!r}", receipt_id=receipt)
        if (
            len(buffered.publications) + len(buffered.settles) >= MAX_TRANSACTION_MESSAGES
            or self._transaction_bytes > MAX_TRANSACTION_BYTES
        ):
            raise TransactionTooLarge(
                f"transactions may buffer up to {MAX_TRANSACTION_MESSAGES} frames and "
                f"{MAX_TRANSACTION_BYTES} bytes per connection",
                receipt_id=receipt,
            )
        return buffered

    def _connect(self, frame: Frame) -> Connect:
        version = _negotiate(frame)
        heartbeat = _heartbeat(frame, version)
        self.version = version
        self.codec.version = version
        self._client_heartbeat = heartbeat
        self._client_id = frame.header("client-id")
        self.state = State.AUTHENTICATING
        return Connect(
            version,
            frame.header("login"),
            frame.header("passcode"),
            frame.header("host"),
            heartbeat,
            frame.header("client-id"),
        )

    def _send(self, frame: Frame, receipt: str | None) -> Event | None:
        publication = publication_from_send(frame, self.producer)
        transaction = frame.header("transaction")
        if transaction is None:
            return Publish(publication, receipt)
        self._transaction_bytes += len(publication.payload)
        self._buffer(transaction, receipt).publications.append(publication)
        return ReceiptRequest(receipt) if receipt is not None else None

    def _end_transaction(self, transaction: str, receipt: str | None) -> _Transaction:
        ended = self._transactions.pop(transaction, None)
        if ended is None:
            raise InvalidFrame(f"unknown transaction {transaction!r}", receipt_id=receipt)
        self._transaction_bytes -= sum(len(p.payload) for p in ended.publications)
        return ended

    def _drop_transactions(self) -> None:
        self._transactions.clear()
        self._transaction_bytes = 0

    def connected(self, session: str) -> None:
        """Send CONNECTED; fixes the heart-beat intervals both ways.

        The producer of every message is ``stomp:<client-id>`` when CONNECT named one (so
        that ``message-id`` dedup spans reconnects), else ``stomp:<session>``.
        """
        if self.state is not State.AUTHENTICATING:
            raise RuntimeError(f"connected() in state {self.state}")
        self.state = State.CONNECTED
        self.producer = f"stomp:{self._client_id or session}"
        self.codec.max_frame_size = self._max_frame_size
        headers = [("version", self.version.value), ("server", self.server), ("session", session)]
        if self.version is not Version.V1_0:
            sx, sy = self.heartbeat
            cx, cy = self._client_heartbeat
            headers.append(("heart-beat", f"{sx},{sy}"))
            if sx and cy:
                self.send_interval = max(sx, cy) / 1000.0
            if cx and sy:
                self.receive_timeout = max(cx, sy) * HEARTBEAT_TOLERANCE / 1000.0
        self._send_frame(Frame("CONNECTED", tuple(headers)))

    def message(self, subscription: str, serial: int, delivery: Deliver) -> bool:
        """Send one delivery to ``subscription`` as a MESSAGE frame (remembered for its
        ACK); False, sending nothing, when the subscription is gone (``Subscriptions.
        message``); raises, sending nothing, when the frame cannot carry it."""
        frame = self.subscriptions.message(
            subscription,
            serial,
            delivery.message,
            delivery.delivery_count,
            delivery.redelivered,
        )
        if frame is None:
            return False
        self._send_frame(frame)
        return True

    def receipt(self, receipt_id: str) -> None:
        self._send_frame(Frame("RECEIPT", (("receipt-id", receipt_id),)))

    def error(self, exc: KeygateError, receipt_id: str | None = None) -> None:
        """Send the ERROR frame for ``exc``; the connection is closed from now on."""
        self.state = State.CLOSED
        self._drop_transactions()
        if isinstance(exc, StompProtocolError):
            receipt_id = receipt_id or exc.receipt_id
            extra = exc.headers
        else:
            extra = ()
        body = f"{exc.code}: {exc.message}\n".encode()
        headers = [("message", error_message(exc))]
        if receipt_id is not None:
            headers.append(("receipt-id", receipt_id))
        headers += [
            *extra,
            ("content-type", "text/plain"),
            ("content-length", str(len(body))),
        ]
        self._send_frame(Frame("ERROR", tuple(headers), body))


__all__ = ["HEARTBEAT", "ServerConnection", "State"]
