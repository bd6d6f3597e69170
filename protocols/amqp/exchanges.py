"""Exchanges and how AMQP routing maps onto keygate's topic space.

keygate routes by topic subscriptions on queues (MQTT-style ``/`` levels, ``+`` and ``#``).
An exchange is therefore only a namespace plus a matching rule. Declared exchanges are
kept by the gateway (``Sink.save_amqp_exchange``, in SQL) and loaded when the listener
starts, so a publisher need not re-declare after a restart or failover; ``Exchanges``
collects each declare and delete for the listener to store before it answers. Bindings
are persisted too: each becomes a topic subscription of the queue.

- ``amq.topic`` is the shared topic space, the one MQTT and STOMP ``/topic/`` use (as
  RabbitMQ's MQTT and STOMP plugins use amq.topic): ``.`` becomes ``/`` (a ``/`` is kept,
  as STOMP does), so AMQP ``sensors.room1`` and MQTT ``sensors/room1`` are one topic. In
  binding keys ``*`` → ``+`` and ``#`` → ``#``.
- Any other exchange ``X`` owns the namespace ``$amqp/X``: a topic exchange maps words to
  levels under it; a direct exchange keeps the whole routing key as one level (exact
  match); a fanout exchange publishes to ``$amqp/X`` and every binding is that topic.
- The default exchange ``""`` is not a topic at all: it addresses the queue named by the
  routing key.

Literal ``+``, ``#`` and ``/`` inside direct keys and declared-topic words are
percent-escaped, so they never act as wildcards. MQTT allows ``#`` only as the last level,
so an AMQP binding key with ``#`` elsewhere is refused (406).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from protocols.amqp.constants import ReplyCode
from protocols.amqp.errors import AmqpChannelError, AmqpConnectionError

NAMESPACE: Final = "$amqp"
TOPIC_EXCHANGE: Final = "amq.topic"
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
        # Declares (type) and deletes (None) not yet stored by the listener.
        self._unsaved: dict[str, str | None] = {}

    def load(self, stored: Mapping[str, str]) -> None:
        """The exchanges the gateway kept (name -> type), at listener start."""
        for name, type_name in stored.items():
            self._declared[name] = Exchange(name, ExchangeType(type_name))

    def take_unsaved(self) -> dict[str, str | None]:
        """The declares (name -> type) and deletes (name -> None) to store, once each."""
        unsaved, self._unsaved = self._unsaved, {}
        return unsaved

    def get(self, name: str) -> Exchange:
        """The exchange, or a 404 channel error. ``amq.default`` is the default exchange."""
        if name == "amq.default":
            name = ""
        exchange = _BUILTIN.get(name) or self._declared.get(name)
        if exchange is None:
            raise AmqpChannelError(ReplyCode.NOT_FOUND, f"no exchange '{name}' in vhost '/'")
        return exchange

    def declare(self, name: str, type_name: str, *, passive: bool) -> Exchange:
        if not _NAME_RE.match(name):
            raise AmqpChannelError(ReplyCode.PRECONDITION_FAILED, f"invalid exchange name {name!r}")
        if passive:
            return self.get(name)
        try:
            kind = ExchangeType(type_name)
        except ValueError as e:
            raise AmqpConnectionError(
                ReplyCode.COMMAND_INVALID, f"unknown exchange type '{type_name}'"
            ) from e
        existing = _BUILTIN.get(name) or self._declared.get(name)
        if existing is not None:
            if existing.type is not kind:
                raise AmqpChannelError(
                    ReplyCode.PRECONDITION_FAILED,
                    f"exchange '{name}' exists with type '{existing.type}'",
                )
            if name in self._declared:
                self._unsaved[name] = existing.type.value  # stored again: idempotent
            return existing
        if name == "" or name.startswith("amq."):
            raise AmqpChannelError(ReplyCode.ACCESS_REFUSED, f"exchange name '{name}' is reserved")
        exchange = Exchange(name, kind)
        self._declared[name] = exchange
        self._unsaved[name] = kind.value
        return exchange

    def delete(self, name: str) -> None:
        if name in _BUILTIN or name.startswith("amq."):
            raise AmqpChannelError(ReplyCode.ACCESS_REFUSED, f"exchange '{name}' is built in")
        if self._declared.pop(name, None) is None:
            raise AmqpChannelError(ReplyCode.NOT_FOUND, f"no exchange '{name}' in vhost '/'")
        self._unsaved[name] = None


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
    "NAMESPACE",
    "TOPIC_EXCHANGE",
    "Exchange",
    "ExchangeType",
    "Exchanges",
    "binding_pattern",
    "publish_topic",
]
