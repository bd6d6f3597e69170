"""AMQP errors: a reply code plus the method that caused it, for Channel.Close/Connection.Close.

``AmqpConnectionError`` closes the whole connection (hard error); ``AmqpChannelError``
closes one channel (soft error). ``reply_for`` maps the gateway's error tree to a reply.
"""

from __future__ import annotations

from core.errors import (
    AlreadyExists,
    AuthError,
    Conflict,
    InvalidArgument,
    KeygateError,
    NotFound,
    ProtocolError,
    PublishRejected,
)
from protocols.amqp.constants import ReplyCode


class AmqpError(ProtocolError):
    """An AMQP-level failure carrying the reply code and the offending method's ids."""

    code = "amqp-error"

    def __init__(
        self, reply_code: ReplyCode, text: str, class_id: int = 0, method_id: int = 0
    ) -> None:
        super().__init__(text)
        self.reply_code = reply_code
        self.class_id = class_id
        self.method_id = method_id


class AmqpConnectionError(AmqpError):
    """A hard error: the server sends Connection.Close and drops the connection."""

    code = "amqp-connection-error"


class AmqpChannelError(AmqpError):
    """A soft error: the server sends Channel.Close; the connection stays usable."""

    code = "amqp-channel-error"


def reply_for(error: KeygateError) -> tuple[ReplyCode, str]:
    """The soft reply code for a gateway error raised by a channel operation."""
    if isinstance(error, AmqpError):
        return error.reply_code, error.message
    if isinstance(error, AuthError):
        return ReplyCode.ACCESS_REFUSED, error.message
    if isinstance(error, NotFound):
        return ReplyCode.NOT_FOUND, error.message
    if isinstance(error, AlreadyExists | Conflict | InvalidArgument | PublishRejected):
        return ReplyCode.PRECONDITION_FAILED, error.message
    # StorageError, Unavailable and the unexpected: no soft code means "try again later",
    # and 541 on the channel keeps the connection (and its other channels) alive through a
    # database hiccup.
    return ReplyCode.INTERNAL_ERROR, error.message


__all__ = ["AmqpChannelError", "AmqpConnectionError", "AmqpError", "reply_for"]
