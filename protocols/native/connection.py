"""Connection state machines for both ends of a native connection (sans-IO, h11 style).

Each side feeds received bytes to ``receive_data`` and pulls events with ``next_event``;
it turns events into bytes with ``send``. The machine checks what may happen when:

    AWAIT_HELLO --Hello/HelloOk--> OPEN --Close (either way)--> CLOSING --the other Close--> CLOSED
                                        (Error id 0 either way, from any state: CLOSED)

- Before OPEN only the handshake (and ERROR/CLOSE) may pass; HELLO comes exactly once.
- CLOSE is a handshake too: the side that sent it sends nothing more but still reads the
  answers to what it sent before (the gateway's PUBLISH_OKs, for one) until the peer's
  CLOSE; the side that received it reads nothing more but may still answer, then sends
  its own CLOSE.
- Each role may only send its own frame types (a client never sends DELIVER).
- Requests that expect a response carry a non-zero request id.
- The client remembers which requests are outstanding and rejects a response to an id it
  never sent, or of the wrong kind (a BIND answered by PUBLISH_OK).

Violations by the peer raise ``NativeProtocolError``; violations by the local caller raise
``RuntimeError`` (a bug, not bad input).

Why ``send`` returns bytes rather than buffering them for a ``data_to_send()`` as the MQTT
and AMQP connections do: the gateway needs a run of frames' bytes on their own. The
server writes DELIVERs with ``append_deliver`` straight from the messages, into pieces that
go into the outbox with their auto-ack ids and the way to encode them again (held as
messages, not as bytes, while the peer reads slowly), and a DELIVER the wire cannot carry
raises there and is dead-lettered alone, without touching frames around it. Both
sides share this class: the SDK (gateway/client/connection.py, consumer.py) writes each
request's bytes as it sends it, and about thirty test call sites feed one side's ``send``
straight into the other's ``receive_data``. A buffer would turn each of those into
``send(event)`` then ``data_to_send()``: more calls for the same bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from enum import Enum
from typing import Final

from protocols.native.codec import Codec
from protocols.native.encoding import DeliveredMessage, append_deliver, append_publish_ok
from protocols.native.errors import NativeProtocolError, UnsupportedVersion
from protocols.native.events import (
    DEFAULT_MAX_FRAME,
    MIN_MAX_FRAME,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    Ack,
    AckCumulative,
    Bind,
    BindOk,
    Close,
    Credit,
    DeclareQueue,
    DeleteQueue,
    Deliver,
    Error,
    Event,
    FlowClosed,
    Hello,
    HelloOk,
    Nack,
    Ok,
    PartitionsChanged,
    Ping,
    Pong,
    Publish,
    PublishOk,
    QueueOk,
    Unbind,
)


class ConnectionState(Enum):
    AWAIT_HELLO = "await-hello"
    OPEN = "open"
    CLOSING = "closing"  # one side's CLOSE has passed, not yet the other's
    CLOSED = "closed"


CLIENT_EVENTS: Final[frozenset[type[Event]]] = frozenset(
    {
        Hello,
        Publish,
        Bind,
        Ack,
        AckCumulative,
        Nack,
        Credit,
        Unbind,
        DeclareQueue,
        DeleteQueue,
        Ping,
        Pong,
        Error,
        Close,
    }
)
SERVER_EVENTS: Final[frozenset[type[Event]]] = frozenset(
    {
        HelloOk,
        PublishOk,
        BindOk,
        Deliver,
        PartitionsChanged,
        FlowClosed,
        Ok,
        QueueOk,
        Ping,
        Pong,
        Error,
        Close,
    }
)
# Request type -> the response types that may answer it (ERROR answers anything).
RESPONSES: Final[dict[type[Event], tuple[type[Event], ...]]] = {
    Hello: (HelloOk,),
    Publish: (PublishOk,),
    Bind: (BindOk,),
    Unbind: (Ok,),
    DeclareQueue: (QueueOk,),
    DeleteQueue: (Ok,),
    Ping: (Pong,),
    Ack: (Ok,),
    AckCumulative: (Ok,),
    Nack: (Ok,),
    Credit: (Ok,),
}
# Requests whose response is mandatory, so their id must be non-zero. Settlements and
# CREDIT are fire-and-forget with id 0 and confirmed with OK when given an id.
_NEED_ID: Final = frozenset({Hello, Publish, Bind, Unbind, DeclareQueue, DeleteQueue, Ping})
_HANDSHAKE: Final = frozenset({Hello, HelloOk, Error, Close})


def negotiate_max_frame(requested: int, offered: int) -> int:
    """Both sides' limits, the smaller wins; 0 means the default."""
    return max(MIN_MAX_FRAME, min(requested or DEFAULT_MAX_FRAME, offered or DEFAULT_MAX_FRAME))


class _Connection(ABC):
    _ours: frozenset[type[Event]]
    _theirs: frozenset[type[Event]]

    def __init__(self, max_frame: int) -> None:
        # Until HELLO_OK both sides read and write with the default limit.
        self._codec = Codec(max(MIN_MAX_FRAME, max_frame))
        self.state = ConnectionState.AWAIT_HELLO
        self.version = PROTOCOL_VERSION
        self._opened = False  # the handshake is done (stays so while closing)
        self._close_sent = False
        self._close_received = False

    @property
    def max_frame(self) -> int:
        return self._codec.max_frame

    def receive_data(self, data: bytes) -> None:
        self._codec.receive_data(data)

    def next_event(self) -> Event | None:
        """The next event from the peer, None when more bytes are needed.

        Raises NativeProtocolError for malformed or out-of-order input; after CLOSED,
        further bytes are ignored.
        """
        if self.state is ConnectionState.CLOSED or self._close_received:
            return None
        event = self._codec.next_event()
        if event is None:
            return None
        kind = type(event)
        if kind not in self._theirs:
            raise NativeProtocolError(f"{kind.__name__} may not be sent by the peer")
        if not self._opened:
            if kind not in _HANDSHAKE:
                raise NativeProtocolError(f"{kind.__name__} before the HELLO handshake")
        elif kind is Hello or kind is HelloOk:
            raise NativeProtocolError(f"{kind.__name__} after the handshake")
        if kind in _NEED_ID and event.request_id == 0:
            raise NativeProtocolError(f"{kind.__name__} needs a non-zero request id")
        self._received(event)
        if kind is Close:
            self._close_received = True
            self.state = ConnectionState.CLOSED if self._close_sent else ConnectionState.CLOSING
        elif kind is Error and event.request_id == 0:
            self.state = ConnectionState.CLOSED
        return event

    def send(self, event: Event) -> bytes:
        """Encode ``event``; raises RuntimeError if this side may not send it now."""
        kind = type(event)
        if self.state is ConnectionState.CLOSED or self._close_sent:
            raise RuntimeError(f"cannot send {kind.__name__}: the connection is closed")
        if kind not in self._ours:
            raise RuntimeError(f"this side may not send {kind.__name__}")
        if not self._opened and kind not in _HANDSHAKE:
            raise RuntimeError(f"cannot send {kind.__name__} before the handshake")
        if kind in _NEED_ID and event.request_id == 0:
            raise RuntimeError(f"{kind.__name__} needs a non-zero request id")
        data = self._codec.encode(event)
        self._sent(event)
        if kind is Close:
            self._close_sent = True
            self.state = ConnectionState.CLOSED if self._close_received else ConnectionState.CLOSING
        elif kind is Error and event.request_id == 0:
            self.state = ConnectionState.CLOSED
        return data

    @abstractmethod
    def _received(self, event: Event) -> None:
        """Role-specific bookkeeping of an accepted incoming event (may raise)."""

    @abstractmethod
    def _sent(self, event: Event) -> None:
        """Role-specific bookkeeping of an outgoing event."""


class ServerConnection(_Connection):
    """The gateway's end. After ``next_event`` returns Hello, authenticate, then send
    ``HelloOk`` built by ``accept`` (or ``Error`` + ``Close``)."""

    _ours = SERVER_EVENTS
    _theirs = CLIENT_EVENTS

    def __init__(
        self, max_frame: int = DEFAULT_MAX_FRAME, *, max_login_frame: int = MIN_MAX_FRAME
    ) -> None:
        # Until HELLO_OK only a login-sized frame is read: nobody unauthenticated may make
        # the gateway buffer a 16 MiB frame.
        super().__init__(min(max_frame, max_login_frame))
        self._server_max_frame = max(MIN_MAX_FRAME, max_frame)
        self.hello: Hello | None = None

    @property
    def client_name(self) -> str | None:
        return self.hello.client_name if self.hello else None

    def accept(self, server_name: str, session_id: str) -> HelloOk:
        """The HELLO_OK answering the received HELLO with negotiated version and frame size.

        Raises UnsupportedVersion when the client speaks no version this side does (send
        its code in an ERROR and close).
        """
        if self.hello is None:
            raise RuntimeError("accept() before a Hello was received")
        version = min(self.hello.version, max(SUPPORTED_VERSIONS))
        if version not in SUPPORTED_VERSIONS:
            raise UnsupportedVersion(
                f"client speaks version {self.hello.version}; "
                f"this server speaks {sorted(SUPPORTED_VERSIONS)}"
            )
        return HelloOk(
            request_id=self.hello.request_id,
            version=version,
            server_name=server_name,
            session_id=session_id,
            max_frame=negotiate_max_frame(self.hello.max_frame, self._server_max_frame),
        )

    def append_deliver(
        self,
        out: bytearray,
        flow_id: str,
        message: DeliveredMessage,
        delivery_count: int,
        redelivered: bool,
    ) -> None:
        """Append the DELIVER of ``message`` to ``out``: what ``send`` makes of a
        ``Deliver`` event with these fields, without the event, for a run of deliveries
        written as one. RuntimeError unless OPEN (or CLOSING with the peer's CLOSE received);
        a frame the wire cannot carry raises
        as ``send`` does and leaves ``out`` unchanged."""
        self._check_open("DELIVER")
        append_deliver(out, flow_id, message, delivery_count, redelivered, self._codec.max_frame)

    def append_publish_ok(
        self, out: bytearray, request_id: int, message_ids: Sequence[str], duplicate: bool
    ) -> None:
        """Append a PUBLISH_OK to ``out``: what ``send`` makes of a ``PublishOk`` with
        these fields, without the event, for a lot's confirms written as one. Raises as
        ``append_deliver`` does."""
        self._check_open("PUBLISH_OK")
        if request_id == 0:
            raise RuntimeError("PublishOk needs a non-zero request id")
        append_publish_ok(out, request_id, message_ids, duplicate, self._codec.max_frame)

    def _check_open(self, frame: str) -> None:
        # Open, or closing with the peer's CLOSE received: answers may still go out.
        if self.state is not ConnectionState.OPEN and (
            self.state is not ConnectionState.CLOSING or self._close_sent
        ):
            raise RuntimeError(f"cannot send {frame} while {self.state.name}")

    def _received(self, event: Event) -> None:
        if isinstance(event, Hello):
            if self.hello is not None:
                raise NativeProtocolError("HELLO sent twice")
            self.hello = event

    def _sent(self, event: Event) -> None:
        if isinstance(event, HelloOk):
            if self.hello is None:
                raise RuntimeError("HELLO_OK before a HELLO was received")
            self.state = ConnectionState.OPEN
            self._opened = True
            self.version = event.version
            self._codec.max_frame = event.max_frame


class ClientConnection(_Connection):
    """The SDK's end. Send ``Hello`` first; ``next_request_id`` numbers requests."""

    _ours = CLIENT_EVENTS
    _theirs = SERVER_EVENTS

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        super().__init__(max_frame)
        self._next_id = 1
        self._pending: dict[int, type[Event]] = {}
        self.server_name: str | None = None
        self.session_id: str | None = None

    def next_request_id(self) -> int:
        """A fresh non-zero u32 id, wrapping around and skipping ids still outstanding."""
        while True:
            rid = self._next_id
            self._next_id = rid % 0xFFFF_FFFF + 1
            if rid not in self._pending:
                return rid

    @property
    def outstanding(self) -> int:
        return len(self._pending)

    def _sent(self, event: Event) -> None:
        kind = type(event)
        if kind in RESPONSES and event.request_id != 0:
            if event.request_id in self._pending:
                raise RuntimeError(f"request id {event.request_id} is already outstanding")
            self._pending[event.request_id] = kind

    def _received(self, event: Event) -> None:
        kind = type(event)
        if kind in (Deliver, PartitionsChanged, FlowClosed, Ping, Close) or event.request_id == 0:
            return
        request = self._pending.pop(event.request_id, None)
        if request is None:
            raise NativeProtocolError(
                f"{kind.__name__} answers request id {event.request_id}, which is not pending"
            )
        if kind is not Error and kind not in RESPONSES[request]:
            raise NativeProtocolError(f"{kind.__name__} cannot answer {request.__name__}")
        if isinstance(event, HelloOk):
            if event.version not in SUPPORTED_VERSIONS:
                raise UnsupportedVersion(f"server chose unsupported version {event.version}")
            self.state = ConnectionState.OPEN
            self._opened = True
            self.version = event.version
            self.server_name = event.server_name
            self.session_id = event.session_id
            self._codec.max_frame = event.max_frame


__all__ = [
    "CLIENT_EVENTS",
    "RESPONSES",
    "SERVER_EVENTS",
    "ClientConnection",
    "ConnectionState",
    "ServerConnection",
    "negotiate_max_frame",
]
