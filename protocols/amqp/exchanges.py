"""Exchanges and how AMQP routing maps onto keygate's topic space.

keygate routes by topic subscriptions on queues (MQTT-style ``/`` levels, ``+`` and ``#``).
An exchange is therefore only a namespace plus a matching rule; it lives in listener
memory and is not persisted (applications re-declare their exchanges on connect, as they
do with RabbitMQ). Bindings are persisted: each becomes a topic subscription of the queue.

- ``amq.topic`` is the shared topic space, the one MQTT and STOMP ``/topic/`` use (as
  RabbitMQ's MQTT and STOMP plugins use amq.topic): ``.`` becomes ``/`` (a ``/`` is kept,
  as STOMP does), so AMQP ``sensors.room1`` and MQTT ``sensors/room1`` are one topic. In
  binding keys ``*`` → ``+`` and ``#`` → ``#``.
- Any other exchange ``X`` owns the namespace ``$amqp/X``: a topic exchange maps words to
  levels under it; a direct exchange keeps the whole routing key as one level (exact
  match); a fanout exchange publishes to ``$amqp/X`` and every binding is that topic.
- The default exchange ``""`` is not a topic at all: it addresses the queue named by the
  routing key.
- RabbitMQ's delayed-message exchange (type ``x-delayed-message``) routes as its
  ``x-delayed-type``; the ``x-delay`` header delays delivery on every exchange.

Literal ``+``, ``#`` and ``/`` inside direct keys and declared-topic words are
percent-escaped, so they never act as wildcards. MQTT allows ``#`` only as the last level,
so an AMQP binding key with ``#`` elsewhere is refused (406).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from protocols.amqp.constants import ReplyCode
from protocols.amqp.errors import AmqpChannelError, AmqpConnectionError

NAMESPACE: Final = "$amqp"
TOPIC_EXCHANGE: Final = "amq.topic"
DELAYED_TYPE: Final = "x-delayed-message"
_NAME_RE: Final = re.compile(r"^[A-Za-z0-9_.:\-]{0,127}$")
_ESCAPES: Final = str.maketrans({"%": "%25", "/": "%2F", "+": "%2B", "#": "%23"})


class ExchangeType(StrEnum):
    DIRECT = "direct"
    TOPIC = "topic"
    FANOUT = "fanout"


@dataclass(frozen=True, slots=True)
class Exchange:
    name: str
    type: ExchangeType
    # Declared as RabbitMQ's delayed-message exchange (type "x-delayed-message" routing as
    # its x-delayed-type); keygate honours x-delay on every exchange, so only a re-declare
    # tells the two apart.
    delayed: bool = False

    @property
    def type_name(self) -> str:
        return DELAYED_TYPE if self.delayed else self.type.value


_BUILTIN: Final = {
    "": Exchange("", ExchangeType.DIRECT),
    "amq.direct": Exchange("amq.direct", ExchangeType.DIRECT),
    TOPIC_EXCHANGE: Exchange(TOPIC_EXCHANGE, ExchangeType.TOPIC),
    "amq.fanout": Exchange("amq.fanout", ExchangeType.FANOUT),
}


class Exchanges:
    """The exchanges of one listener, shared by its connections."""

    def __init__(self) -> None:
        self._declared: dict[str, Exchange] = {}

    def find(self, name: str) -> Exchange | None:
        """The exchange, or None. ``amq.default`` is the default exchange."""
        if name == "amq.default":
            name = ""
        return _BUILTIN.get(name) or self._declared.get(name)

    def get(self, name: str) -> Exchange:
        """The exchange, or a 404 channel error."""
        exchange = self.find(name)
        if exchange is None:
            raise AmqpChannelError(ReplyCode.NOT_FOUND, f"no exchange '{name}' in vhost '/'")
        return exchange

    def declare(
        self,
        name: str,
        type_name: str,
        *,
        passive: bool,
        create: bool,
        arguments: Mapping[str, Any] | None = None,
    ) -> Exchange:
        """The exchange, created if absent and ``create`` (the user may administer)."""
        if not _NAME_RE.match(name):
            raise AmqpChannelError(ReplyCode.PRECONDITION_FAILED, f"invalid exchange name {name!r}")
        if passive:
            return self.get(name)
        wanted = _exchange(name, type_name, arguments or {})
        existing = self.find(name)
        if existing is not None:
            argument, received, current = "type", wanted.type_name, existing.type_name
            if received == current and existing.type is not wanted.type:
                argument, received, current = "x-delayed-type", wanted.type, existing.type
            if received != current:
                raise AmqpChannelError(
                    ReplyCode.PRECONDITION_FAILED,
                    f"inequivalent arg '{argument}' for exchange '{name}' in vhost '/': "
                    f"received '{received}' but current is '{current}'",
                )
            return existing
        if name == "" or name.startswith("amq."):
            raise AmqpChannelError(ReplyCode.ACCESS_REFUSED, f"exchange name '{name}' is reserved")
        if not create:
            raise AmqpChannelError(
                ReplyCode.ACCESS_REFUSED, f"not allowed to create exchange '{name}'"
            )
        self._declared[name] = wanted
        return wanted

    def delete(self, name: str) -> None:
        """Delete a declared exchange; deleting one that does not exist is OK (RabbitMQ)."""
        if name in _BUILTIN or name.startswith("amq."):
            raise AmqpChannelError(ReplyCode.ACCESS_REFUSED, f"exchange '{name}' is built in")
        self._declared.pop(name, None)


def _exchange(name: str, type_name: str, arguments: Mapping[str, Any]) -> Exchange:
    """The exchange a declare asks for; headers exchanges are refused (540)."""
    delayed = type_name == DELAYED_TYPE
    if delayed:
        routed = arguments.get("x-delayed-type")
        type_name = routed.decode() if isinstance(routed, bytes) else str(routed)
        if routed is None:
            raise AmqpChannelError(
                ReplyCode.PRECONDITION_FAILED, "Invalid argument, 'x-delayed-type' must be set"
            )
    if type_name == "headers":
        raise AmqpChannelError(
            ReplyCode.NOT_IMPLEMENTED,
            "headers exchanges are not supported: route by topic or by queue name",
        )
    try:
        return Exchange(name, ExchangeType(type_name), delayed)
    except ValueError as e:
        raise AmqpConnectionError(
            ReplyCode.COMMAND_INVALID, f"invalid exchange type '{type_name[:40]}'"
        ) from e


def _escape(word: str) -> str:
    return word.translate(_ESCAPES)


def publish_topic(exchange: Exchange, routing_key: str) -> str | None:
    """The topic a publish to ``exchange`` goes to; None when nothing can match it."""
    if exchange.name == TOPIC_EXCHANGE:
        # A topic that cannot exist in the shared space (empty, or holding MQTT wildcard
        # characters) cannot match any subscription: it is unroutable, not an error.
        if not routing_key or "+" in routing_key or "#" in routing_key:
            return None
        return routing_key.replace(".", "/")
    prefix = f"{NAMESPACE}/{exchange.name}"
    if exchange.type is ExchangeType.FANOUT:
        return prefix
    if exchange.type is ExchangeType.DIRECT:
        return f"{prefix}/{_escape(routing_key)}"
    return "/".join([prefix, *(_escape(w) for w in routing_key.split("."))])


def binding_pattern(exchange: Exchange, binding_key: str) -> str:
    """The topic subscription that stands for binding a queue with ``binding_key``."""
    if exchange.name == "":
        raise AmqpChannelError(
            ReplyCode.ACCESS_REFUSED, "operation not permitted on the default exchange"
        )
    if exchange.type is ExchangeType.FANOUT:
        return f"{NAMESPACE}/{exchange.name}"
    if exchange.type is ExchangeType.DIRECT:
        return f"{NAMESPACE}/{exchange.name}/{_escape(binding_key)}"
    words = binding_key.split(".")
    levels = []
    for index, word in enumerate(words):
        if word == "#":
            if index != len(words) - 1:
                raise AmqpChannelError(
                    ReplyCode.PRECONDITION_FAILED,
                    f"binding key {binding_key!r}: '#' is supported only as the last word",
                )
            levels.append("#")
        elif word == "*":
            levels.append("+")
        elif exchange.name == TOPIC_EXCHANGE:
            if "+" in word or "#" in word:
                raise AmqpChannelError(
                    ReplyCode.PRECONDITION_FAILED,
                    f"binding key {binding_key!r}: '+' and '#' cannot appear inside a word",
                )
            levels.append(word)
        else:
            levels.append(_escape(word))
    if exchange.name == TOPIC_EXCHANGE:
        return "/".join(levels)
    return "/".join([NAMESPACE, exchange.name, *levels])


__all__ = [
    "DELAYED_TYPE",
    "NAMESPACE",
    "TOPIC_EXCHANGE",
    "Exchange",
    "ExchangeType",
    "Exchanges",
    "binding_pattern",
    "publish_topic",
]
