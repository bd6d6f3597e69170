"""One AMQP channel: its state, content reassembly and publisher-confirm numbering."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from pamqp import base, body, commands, header

from core.errors import InvalidArgument, KeygateError, MessageTooLarge, NoRoute
from protocols.amqp.constants import ReplyCode
from protocols.amqp.consumers import ChannelConsumers
from protocols.amqp.errors import AmqpChannelError, AmqpConnectionError
from protocols.amqp.events import Publish
from protocols.amqp.mapping import to_publication


class ChannelState(Enum):
    OPEN = "open"
    # We sent Channel.Close: everything but Close/Close-Ok is discarded until Close-Ok.
    CLOSING = "closing"


@dataclass(slots=True)
class Content:
    """A Basic.Publish waiting for its header and body frames."""

    method: commands.Basic.Publish
    queue: str | None
    topic: str | None
    properties: commands.Basic.Properties | None = None
    body_size: int = 0
    parts: list[bytes] = field(default_factory=list)
    received: int = 0
    too_large: MessageTooLarge | None = None


@dataclass(slots=True)
class Channel:
    number: int
    serial: int
    state: ChannelState = ChannelState.OPEN
    confirming: bool = False
    next_tag: int = 1
    content: Content | None = None
    consumers: ChannelConsumers = field(default_factory=ChannelConsumers)

    def expect_method(self, method: base.Frame) -> None:
        if self.content is not None:
            raise AmqpConnectionError(
                ReplyCode.UNEXPECTED_FRAME,
                f"{method.name} on channel {self.number} while content was expected",
            )

    def start_content(self, content: Content) -> None:
        self.content = content

    def receive_content(
        self, payload: header.ContentHeader | body.ContentBody, max_message_size: int
    ) -> Content | None:
        """Add a content frame; return the Content once its body is complete.

        The body of a message over ``max_message_size`` is counted but not kept.
        """
        content = self.content
        is_header = isinstance(payload, header.ContentHeader)
        if content is None or (content.properties is None) != is_header:
            raise AmqpConnectionError(
                ReplyCode.UNEXPECTED_FRAME, f"unexpected content frame on channel {self.number}"
            )
        if isinstance(payload, header.ContentHeader):
            content.properties = payload.properties
            content.body_size = payload.body_size
            if payload.body_size > max_message_size:
                content.too_large = MessageTooLarge(
                    f"message of {payload.body_size} bytes exceeds {max_message_size}"
                )
        else:
            content.received += len(payload.value)
            if content.received > content.body_size:
                raise AmqpConnectionError(ReplyCode.FRAME_ERROR, "body longer than its header")
            if content.too_large is None:
                content.parts.append(payload.value)
        if content.received < content.body_size:
            return None
        self.content = None
        return content

    def publish(self, content: Content, username: str | None, producer: str) -> Publish:
        """The Publish event for a complete message; numbers it in confirm mode."""
        assert content.properties is not None
        method, properties = content.method, content.properties
        payload = b"".join(content.parts)
        user_id = properties.user_id
        if user_id is not None and username is not None and user_id != username:
            raise AmqpChannelError(
                ReplyCode.PRECONDITION_FAILED,
                f"user_id property {user_id!r} does not match the connection's user",
            )
        rejected: KeygateError | None = content.too_large
        publication = None
        if content.queue is None and content.topic is None:
            rejected = rejected or NoRoute(f"routing key {method.routing_key!r} matches no topic")
        elif rejected is None:
            try:
                publication = to_publication(
                    properties, payload, queue=content.queue, topic=content.topic, producer=producer
                )
            except InvalidArgument as e:
                # In confirm mode the publish is nacked in its turn; a publisher without
                # confirms would never hear of it, so its channel is closed with the reason.
                if not self.confirming:
                    raise AmqpChannelError(ReplyCode.PRECONDITION_FAILED, e.message) from e
                rejected = e.as_outcome()
        tag = None
        if self.confirming:
            tag = self.next_tag
            self.next_tag += 1
        return Publish(
            self.number,
            self.serial,
            False,
            tag,
            publication,
            rejected,
            bool(method.mandatory),
            method.exchange,
            method.routing_key,
            properties,
            payload,
        )


def confirm_frames(settled: Iterable[tuple[int, bool]]) -> list[base.Frame]:
    """Basic.Ack/Nack for delivery tags settled in tag order.

    Tags arrive in order and every earlier tag was confirmed before, so a run of acks can
    be announced with one Basic.Ack(multiple=True) naming its last tag.
    """
    frames: list[base.Frame] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            frames.append(commands.Basic.Ack(delivery_tag=run[-1], multiple=len(run) > 1))
            run.clear()

    for tag, ok in settled:
        if ok:
            run.append(tag)
        else:
            flush()
            frames.append(commands.Basic.Nack(delivery_tag=tag, multiple=False, requeue=False))
    flush()
    return frames


def partial_body_bytes(channels: Iterable[Channel], but: Channel) -> int:
    """Body bytes announced by the content headers of messages still being received on
    ``channels`` other than ``but`` (bodies over max_message_size are not kept)."""
    return sum(
        c.content.body_size
        for c in channels
        if c is not but and c.content is not None and c.content.too_large is None
    )


__all__ = ["Channel", "ChannelState", "Content", "confirm_frames", "partial_body_bytes"]
