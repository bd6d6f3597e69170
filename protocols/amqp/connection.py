"""The sans-IO AMQP 0-9-1 server connection.

How it works (h11-style): the adapter feeds bytes with ``receive_data`` and drains
``next_event()`` until it returns None; bytes to write accumulate in ``data_to_send()``.
Events are the work that needs the gateway (authentication, queue operations, publishes);
the adapter performs them strictly in emission order and reports each result back
(``authenticated``, ``operation_done``, ``published``), which produces the reply frames.
Everything that is pure protocol — negotiation, channels, exchanges, content reassembly,
confirm numbering, error replies — happens here without I/O.

Connection states: AWAIT_HEADER → AWAIT_START_OK → AUTHENTICATING → AWAIT_TUNE_OK →
AWAIT_OPEN → OPEN → CLOSING (we sent Connection.Close) → CLOSED. A hard error in any state
sends Connection.Close with its reply code and waits for Close-Ok; a soft error closes
only its channel.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any, Final

from pamqp import base, body, commands, header, heartbeat

from core.errors import (
    ConnectionLimitReached,
    KeygateError,
    MessageTooLarge,
    NoRoute,
    NotFound,
    PermissionDenied,
)
from protocols._limits import DEFAULT_MAX_LOGIN_FRAME, DEFAULT_MAX_UNCONFIRMED_BYTES
from protocols.amqp import events as ev
from protocols.amqp.channel import (
    Channel,
    ChannelState,
    Content,
    confirm_frames,
    partial_body_bytes,
)
from protocols.amqp.codec import BadProtocolHeader, Frame, FrameReader, content_frames, method_frame
from protocols.amqp.constants import FRAME_MIN_SIZE, PROTOCOL_HEADER, ReplyCode
from protocols.amqp.consuming import Consuming
from protocols.amqp.declaring import Declaring
from protocols.amqp.errors import AmqpChannelError, AmqpConnectionError, AmqpError, reply_for
from protocols.amqp.exchanges import Exchanges, publish_topic
from protocols.amqp.negotiation import credentials, start_method

_MAX_TEXT: Final = 255
_NOT_IMPLEMENTED: Final[dict[type[base.Frame], str]] = {
    commands.Tx.Select: "transactions are not supported: use publisher confirms",
    commands.Exchange.Bind: "exchange-to-exchange bindings are not supported",
    commands.Exchange.Unbind: "exchange-to-exchange bindings are not supported",
}


class State(Enum):
    AWAIT_HEADER = "await-header"
    AWAIT_START_OK = "await-start-ok"
    AUTHENTICATING = "authenticating"
    AWAIT_TUNE_OK = "await-tune-ok"
    AWAIT_OPEN = "await-open"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


# The one method each handshake state accepts (besides Connection.Close).
_HANDSHAKE: Final[dict[State, type[base.Frame]]] = {
    State.AWAIT_START_OK: commands.Connection.StartOk,
    State.AWAIT_TUNE_OK: commands.Connection.TuneOk,
    State.AWAIT_OPEN: commands.Connection.Open,
}


class AmqpConnection(Declaring, Consuming):
    """One client connection's protocol state; no I/O. Exchange and queue methods are in
    ``protocols.amqp.declaring``, consuming (basic.consume, get, ack, ...) in
    ``protocols.amqp.consuming``."""

    def __init__(
        self,
        exchanges: Exchanges,
        *,
        frame_max: int,
        channel_max: int,
        heartbeat: int,
        max_message_size: int,
        max_login_frame: int = DEFAULT_MAX_LOGIN_FRAME,
        max_unconfirmed_bytes: int = DEFAULT_MAX_UNCONFIRMED_BYTES,
    ) -> None:
        # Bytes of publishes held before they are stored: completed ones (the listener
        # stops reading above it) and partial bodies across all channels (refused above it).
        self.max_unconfirmed_bytes = max_unconfirmed_bytes
        self.exchanges = exchanges
        self.frame_max = frame_max
        self.channel_max = channel_max
        self.heartbeat = heartbeat
        self.max_message_size = max_message_size
        self.state = State.AWAIT_HEADER
        self.username: str | None = None
        self._admin = False  # set by authenticated(): may create and delete exchanges
        self.client_id: str | None = None
        self._producer = "amqp:anonymous"  # the producer of its publishes, set at login
        # Until tune-ok the peer may send only login-sized frames (the spec allows 4096).
        self._reader = FrameReader(max(FRAME_MIN_SIZE, min(max_login_frame, frame_max)))
        self._out: list[bytes] = []
        self._events: deque[ev.Event] = deque()
        self._channels: dict[int, Channel] = {}
        self._serials = 0
        self._client_capabilities: dict[str, Any] = {}
        self._blocked = False
        self._handlers: dict[type[base.Frame], Callable[[Channel, Any], None]] = {
            commands.Channel.Close: self._channel_close,
            commands.Channel.CloseOk: self._channel_close_ok,
            commands.Channel.Flow: self._channel_flow,
            **self.declare_handlers(),
            commands.Basic.Publish: self._basic_publish,
            commands.Confirm.Select: self._confirm_select,
            **self.consume_handlers(),
        }

    # -- adapter surface -------------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Take bytes from the socket; process them with ``next_event``."""
        self._reader.feed(data)

    def next_event(self) -> ev.Event | None:
        """The next event for the adapter, or None when more bytes are needed."""
        while not self._events and self.state is not State.CLOSED:
            try:
                if self.state is State.AWAIT_HEADER:
                    if not self._reader.read_protocol_header():
                        break
                    self._send(0, start_method())
                    self.state = State.AWAIT_START_OK
                frame = self._reader.next_frame()
            except BadProtocolHeader:
                self._out.append(PROTOCOL_HEADER)
                self._finish(ReplyCode.FRAME_ERROR, "bad protocol header")
                break
            except AmqpConnectionError as e:
                self._hard_error(e)
                break
            if frame is None:
                break
            self._on_frame(frame)
        return self._events.popleft() if self._events else None

    def data_to_send(self) -> bytes:
        data = b"".join(self._out)
        self._out.clear()
        return data

    def is_current(self, operation: ev.ChannelOperation) -> bool:
        """Whether the operation's channel is still the open channel it came from."""
        channel = self._channels.get(operation.channel)
        return (
            self.state is State.OPEN
            and channel is not None
            and channel.serial == operation.serial
            and channel.state is ChannelState.OPEN
        )

    def authenticated(
        self, error: KeygateError | None, *, admin: bool = False, username: str | None = None
    ) -> None:
        """The outcome of ``Authenticate``; ``admin``: the user may create and delete
        exchanges (declaring an existing one stays open to every user); ``username``: who
        the gateway found the client to be (EXTERNAL: the certificate's user)."""
        if self.state is not State.AUTHENTICATING:
            return
        self._admin = admin
        self.username = username or self.username
        self._producer = f"amqp:{self.client_id or self.username or 'anonymous'}"
        if error is not None:
            # RabbitMQ answers a reached connection limit with 530, bad credentials with 403.
            refusal = (
                ReplyCode.NOT_ALLOWED
                if isinstance(error, ConnectionLimitReached)
                else ReplyCode.ACCESS_REFUSED
            )
            self._hard_error(AmqpConnectionError(refusal, error.message, 10, 11))
            return
        self._send(0, commands.Connection.Tune(self.channel_max, self.frame_max, self.heartbeat))
        self.state = State.AWAIT_TUNE_OK

    def operation_done(
        self, operation: ev.ChannelOperation, result: int, error: KeygateError | None
    ) -> None:
        """Report a queue operation's outcome; ``result`` is its message count."""
        if not self.is_current(operation):
            return
        channel = self._channels[operation.channel]
        if error is not None:
            self._soft_error(channel, error)
            return
        if operation.nowait:
            return
        if isinstance(operation, ev.DeclareQueue):
            self._reply(channel, commands.Queue.DeclareOk(operation.config.name, result, 0))
        elif isinstance(operation, ev.DeleteQueue):
            self._reply(channel, commands.Queue.DeleteOk(result))
        elif isinstance(operation, ev.PurgeQueue):
            self._reply(channel, commands.Queue.PurgeOk(result))
        elif isinstance(operation, ev.BindQueue):
            reply = commands.Queue.UnbindOk() if operation.unbind else commands.Queue.BindOk()
            self._reply(channel, reply)

    def published(self, results: Sequence[tuple[ev.Publish, KeygateError | None]]) -> None:
        """Report publishes in emission order: returns, then coalesced acks and nacks."""
        settled: dict[int, list[tuple[int, bool]]] = {}
        for publish, error in results:
            if not self.is_current(publish):
                continue
            channel = self._channels[publish.channel]
            if isinstance(error, PermissionDenied):
                self._soft_error(channel, error)
                continue
            unroutable = isinstance(error, NoRoute | NotFound)
            if error is not None and publish.mandatory and unroutable:
                self._send_return(channel, publish, ReplyCode.NO_ROUTE, "NO_ROUTE")
            elif error is not None and publish.mandatory and isinstance(error, MessageTooLarge):
                self._send_return(channel, publish, ReplyCode.CONTENT_TOO_LARGE, error.message)
            if publish.delivery_tag is not None:
                ok = error is None or unroutable
                settled.setdefault(channel.number, []).append((publish.delivery_tag, ok))
        for number, tags in settled.items():
            for method in confirm_frames(tags):
                self._send(number, method)

    def set_blocked(self, blocked: bool) -> None:
        """Announce gateway backpressure to clients that understand connection.blocked."""
        if blocked == self._blocked or self.state is not State.OPEN:
            return
        self._blocked = blocked
        if self._client_capabilities.get("connection.blocked"):
            method: base.Frame = (
                commands.Connection.Blocked("keygate is applying backpressure")
                if blocked
                else commands.Connection.Unblocked()
            )
            self._send(0, method)

    def close(self, reply_code: ReplyCode, text: str) -> None:
        """Start a server-initiated close (shutdown: 320 CONNECTION_FORCED)."""
        if self.state in (State.CLOSING, State.CLOSED):
            return
        if self.state is State.AWAIT_HEADER:
            self._finish(reply_code, text)
            return
        self._hard_error(AmqpConnectionError(reply_code, text))

    # -- frames ----------------------------------------------------------------------------

    def _send(self, channel: int, method: base.Frame) -> None:
        self._out.append(method_frame(channel, method))

    def _reply(self, channel: Channel, method: base.Frame) -> None:
        self._send(channel.number, method)

    def _finish(self, reply_code: int, text: str) -> None:
        self.state = State.CLOSED
        self._events.append(ev.ConnectionClosed(reply_code, text))

    def _hard_error(self, error: AmqpError) -> None:
        if self.state in (State.CLOSING, State.CLOSED):
            return
        self._send(
            0,
            commands.Connection.Close(
                error.reply_code, _short(error.message), error.class_id, error.method_id
            ),
        )
        self.state = State.CLOSING

    def _soft_error(self, channel: Channel, error: KeygateError) -> None:
        if channel.state is ChannelState.CLOSING:
            return
        code, text = reply_for(error)
        class_id = error.class_id if isinstance(error, AmqpError) else 0
        method_id = error.method_id if isinstance(error, AmqpError) else 0
        channel.content = None
        channel.state = ChannelState.CLOSING
        self._channel_gone(channel)
        self._reply(channel, commands.Channel.Close(code, _short(text), class_id, method_id))

    def _on_frame(self, frame: Frame) -> None:
        payload = frame.payload
        if isinstance(payload, heartbeat.Heartbeat):
            return
        if self.state is State.CLOSING:
            if isinstance(payload, commands.Connection.CloseOk):
                self._finish(ReplyCode.SUCCESS, "closed")
            elif isinstance(payload, commands.Connection.Close):
                self._send(0, commands.Connection.CloseOk())
                self._finish(payload.reply_code or 0, payload.reply_text or "")
            return
        try:
            if frame.channel == 0:
                self._on_connection_frame(payload)
            else:
                self._on_channel_frame(frame.channel, payload)
        except AmqpConnectionError as e:
            self._hard_error(e)

    def _on_connection_frame(self, payload: Any) -> None:
        if not isinstance(payload, base.Frame):
            raise AmqpConnectionError(ReplyCode.UNEXPECTED_FRAME, "content frame on channel 0")
        if isinstance(payload, commands.Connection.Close):
            self._send(0, commands.Connection.CloseOk())
            self._finish(payload.reply_code or 0, payload.reply_text or "")
        elif isinstance(payload, commands.Connection.Blocked | commands.Connection.Unblocked):
            return
        elif isinstance(payload, _HANDSHAKE.get(self.state, ())):
            if isinstance(payload, commands.Connection.StartOk):
                self._start_ok(payload)
            elif isinstance(payload, commands.Connection.TuneOk):
                self._tune_ok(payload)
            else:
                self.state = State.OPEN
                self._send(0, commands.Connection.OpenOk())
        else:
            raise AmqpConnectionError(
                ReplyCode.COMMAND_INVALID,
                f"unexpected {payload.name} in state {self.state.value}",
                *_ids(payload),
            )

    def _start_ok(self, method: commands.Connection.StartOk) -> None:
        properties = method.client_properties or {}
        capabilities = properties.get("capabilities")
        self._client_capabilities = capabilities if isinstance(capabilities, dict) else {}
        name = properties.get("connection_name")
        self.client_id = name if isinstance(name, str) else None
        self.username, password = credentials(method.mechanism, method.response)
        self.state = State.AUTHENTICATING
        self._events.append(
            ev.Authenticate(method.mechanism, self.username, password, self.client_id)
        )

    def _tune_ok(self, method: commands.Connection.TuneOk) -> None:
        channel_max = method.channel_max or self.channel_max
        frame_max = method.frame_max or self.frame_max
        if channel_max > self.channel_max or not FRAME_MIN_SIZE <= frame_max <= self.frame_max:
            raise AmqpConnectionError(
                ReplyCode.NOT_ALLOWED,
                f"tune-ok outside the offer: channel_max {method.channel_max} "
                f"(<= {self.channel_max}), frame_max {method.frame_max} "
                f"({FRAME_MIN_SIZE}..{self.frame_max})",
                10,
                31,
            )
        self.channel_max, self.frame_max = channel_max, frame_max
        self.heartbeat = method.heartbeat
        self._reader.frame_max = frame_max
        self.state = State.AWAIT_OPEN

    def _on_channel_frame(self, number: int, payload: Any) -> None:
        if self.state is not State.OPEN:
            raise AmqpConnectionError(
                ReplyCode.CHANNEL_ERROR, "channel frame before connection.open"
            )
        channel = self._channels.get(number)
        if isinstance(payload, commands.Channel.Open):
            if channel is not None or number > self.channel_max:
                raise AmqpConnectionError(
                    ReplyCode.CHANNEL_ERROR, f"channel {number} is in use or out of range", 20, 10
                )
            self._serials += 1
            self._channels[number] = Channel(number, self._serials)
            self._send(number, commands.Channel.OpenOk())
            return
        if channel is None:
            raise AmqpConnectionError(ReplyCode.CHANNEL_ERROR, f"channel {number} is not open")
        if channel.state is ChannelState.CLOSING:
            if isinstance(payload, commands.Channel.CloseOk):
                del self._channels[number]
            elif isinstance(payload, commands.Channel.Close):
                self._send(number, commands.Channel.CloseOk())
            return
        if isinstance(payload, header.ContentHeader | body.ContentBody):
            self._on_content(channel, payload)
            return
        channel.expect_method(payload)
        handler = self._handlers.get(type(payload))
        try:
            if handler is None:
                self._unsupported(payload)
            else:
                handler(channel, payload)
        except AmqpChannelError as e:
            e.class_id, e.method_id = _ids(payload)
            self._soft_error(channel, e)

    def _unsupported(self, method: base.Frame) -> None:
        if type(method) in _NOT_IMPLEMENTED:
            raise AmqpChannelError(ReplyCode.NOT_IMPLEMENTED, _NOT_IMPLEMENTED[type(method)])
        if isinstance(method, commands.Tx.Commit | commands.Tx.Rollback):
            raise AmqpChannelError(ReplyCode.PRECONDITION_FAILED, "channel is not transactional")
        raise AmqpConnectionError(
            ReplyCode.COMMAND_INVALID, f"unexpected {method.name} from a client", *_ids(method)
        )

    # -- channel methods ---------------------------------------------------------------------

    def _channel_close(self, channel: Channel, method: commands.Channel.Close) -> None:
        del self._channels[channel.number]
        self._channel_gone(channel)
        self._send(channel.number, commands.Channel.CloseOk())

    def _channel_close_ok(self, channel: Channel, method: commands.Channel.CloseOk) -> None:
        raise AmqpConnectionError(
            ReplyCode.COMMAND_INVALID, "channel.close-ok without close", 20, 41
        )

    def _channel_flow(self, channel: Channel, method: commands.Channel.Flow) -> None:
        # As RabbitMQ: a client may not pause deliveries this way (use basic.qos).
        if not method.active:
            raise AmqpChannelError(
                ReplyCode.NOT_IMPLEMENTED, "channel.flow active=false is not supported"
            )
        self._reply(channel, commands.Channel.FlowOk(True))

    def _confirm_select(self, channel: Channel, method: commands.Confirm.Select) -> None:
        channel.confirming = True
        if not method.nowait:
            self._reply(channel, commands.Confirm.SelectOk())

    def _basic_publish(self, channel: Channel, method: commands.Basic.Publish) -> None:
        exchange = self.exchanges.get(method.exchange)
        if exchange.name == "":
            channel.start_content(Content(method, queue=method.routing_key, topic=None))
        else:
            topic = publish_topic(exchange, method.routing_key)
            channel.start_content(Content(method, queue=None, topic=topic))

    def _on_content(
        self, channel: Channel, payload: header.ContentHeader | body.ContentBody
    ) -> None:
        if isinstance(payload, header.ContentHeader):
            self._check_partial_bytes(channel, payload.body_size)
        content = channel.receive_content(payload, self.max_message_size)
        if content is None:
            return
        try:
            self._events.append(channel.publish(content, self.username, self._producer))
        except AmqpChannelError as e:
            e.class_id, e.method_id = commands.Basic.Publish.index >> 16, 40
            self._soft_error(channel, e)

    def _check_partial_bytes(self, channel: Channel, body_size: int) -> None:
        """Refuse a body that, with the bodies other channels are still receiving, is over
        the budget: 2047 channels x one partial 5 MiB body each must not be held at once.
        The reader cannot wait for room here (the frames that finish the other bodies are
        behind this one), so the connection is closed with 506 resource-error."""
        if len(self._channels) == 1:
            return  # no other channel holds a partial body
        partial = partial_body_bytes(self._channels.values(), channel)
        if partial and partial + body_size > self.max_unconfirmed_bytes:
            raise AmqpConnectionError(
                ReplyCode.RESOURCE_ERROR,
                f"partial message bodies across channels over {self.max_unconfirmed_bytes} bytes",
            )

    def _send_return(self, channel: Channel, publish: ev.Publish, code: int, text: str) -> None:
        try:
            content = content_frames(
                channel.number, publish.properties, publish.payload, self.frame_max
            )
        except ValueError:
            # Headers written wider than the publisher sent them (its 32-bit floats go
            # back as doubles) and over frame_max: no basic.return, the confirm follows.
            return
        method = commands.Basic.Return(code, text, publish.exchange, publish.routing_key)
        self._reply(channel, method)
        self._out.append(content)


def _short(text: str) -> str:
    """A reply text that fits a short string (255 bytes of UTF-8)."""
    return text.encode()[:_MAX_TEXT].decode("utf-8", "ignore")


def _ids(method: base.Frame) -> tuple[int, int]:
    index = getattr(method, "index", 0)
    return index >> 16, index & 0xFFFF


__all__ = ["AmqpConnection", "State"]
