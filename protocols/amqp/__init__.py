"""AMQP 0-9-1 listener: a sans-IO connection on pamqp frames and a thin asyncio adapter."""

from protocols.amqp.connection import AmqpConnection, State
from protocols.amqp.exchanges import Exchanges
from protocols.amqp.listener import AmqpListener

__all__ = ["AmqpConnection", "AmqpListener", "Exchanges", "State"]
