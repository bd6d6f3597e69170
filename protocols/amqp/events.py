"""What the sans-IO connection asks its adapter to do (each needs the Sink).

Every operation names the channel it came from and that channel's ``serial``: a channel
number can be closed and reopened, and a late result must not reach the new channel.
The adapter runs them in the order they were emitted and reports each result back
(``AmqpConnection.authenticated``, ``operation_done``, ``published``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field

from pamqp import commands

from core.errors import KeygateError
from core.frozen import frozen
from core.model import Publication, QueueConfig
from protocols.amqp.consumers import ConsumeRequest, Settled


@frozen(eq=False)
class Authenticate:
    mechanism: str
    username: str | None
    password: str | None
    client_id: str | None


@frozen(eq=False)
class ChannelOperation:
    channel: int
    serial: int
    nowait: bool


@frozen(eq=False)
class DeclareQueue(ChannelOperation):
    """``given`` maps each QueueConfig field the declare named to its x-argument: only
    those must match an existing queue (protocols.amqp.arguments.check_equivalent)."""

    config: QueueConfig
    passive: bool
    given: Mapping[str, str] = field(default_factory=dict)


@frozen(eq=False)
class DeleteQueue(ChannelOperation):
    queue: str
    if_unused: bool
    if_empty: bool


@frozen(eq=False)
class PurgeQueue(ChannelOperation):
    queue: str


@frozen(eq=False)
class BindQueue(ChannelOperation):
    """Queue.Bind (``unbind`` False) or Queue.Unbind as a topic subscription change.
    ``pattern`` None: an unbind from an exchange that does not exist (nothing to do)."""

    queue: str
    pattern: str | None
    unbind: bool


@frozen(eq=False)
class Publish(ChannelOperation):
    """A complete message. ``rejected`` is set when the listener refused it itself
    (too large, unroutable by construction); it still travels in order so that its
    confirm is sent in sequence."""

    delivery_tag: int | None
    publication: Publication | None
    rejected: KeygateError | None
    mandatory: bool
    exchange: str
    routing_key: str
    properties: commands.Basic.Properties
    payload: bytes


@frozen(eq=False)
class Consume(ChannelOperation):
    """basic.consume: bind a flow; answer with ``AmqpConnection.consumed``."""

    request: ConsumeRequest


@frozen(eq=False)
class Cancel(ChannelOperation):
    """basic.cancel of a known consumer: unbind its flow, then ``cancelled``. ``holds``:
    deliveries of the consumer waited for a settle when the cancel was read; then the flow
    is paused instead, and unbound by the settle that ``Settled.drained`` marks."""

    consumer_tag: str
    holds: bool


@frozen(eq=False)
class SettleDeliveries(ChannelOperation):
    """basic.ack, nack, reject or recover, resolved to settles per consumer."""

    settled: tuple[Settled, ...]


@frozen(eq=False)
class Get(ChannelOperation):
    """basic.get: one message of ``group``, answered with ``AmqpConnection.got``."""

    queue: str
    group: str
    no_ack: bool


@frozen(eq=False)
class ChannelGone:
    """A channel closed (by either side): unbind the flows its consumers had."""

    channel: int
    serial: int


@frozen(eq=False)
class ConnectionClosed:
    """The connection is finished: flush what is pending and close the socket."""

    reply_code: int
    reply_text: str


Operation = (
    DeclareQueue
    | DeleteQueue
    | PurgeQueue
    | BindQueue
    | Publish
    | Consume
    | Cancel
    | SettleDeliveries
    | Get
)
Event = Authenticate | Operation | ChannelGone | ConnectionClosed

__all__ = [
    "Authenticate",
    "BindQueue",
    "Cancel",
    "ChannelGone",
    "ChannelOperation",
    "ConnectionClosed",
    "Consume",
    "DeclareQueue",
    "DeleteQueue",
    "Event",
    "Get",
    "Operation",
    "Publish",
    "PurgeQueue",
    "SettleDeliveries",
]
