"""keygate's native SDK: asyncio ``Client`` and its blocking twin ``BlockingClient``.

Names follow Pulsar's Python client (subscribe, receive, batch_receive, acknowledge,
acknowledge_cumulative, negative_acknowledge, close). The wire protocol is described in
docs/native-protocol.md.
"""

from core.errors import KeygateError
from gateway.client.blocking import BlockingClient, BlockingConsumer
from gateway.client.client import DEFAULT_URL, Client
from gateway.client.consumer import Consumer, Message
from gateway.client.errors import (
    ClientClosed,
    ClientError,
    ConnectionLost,
    ConsumerClosed,
    error_from_code,
)
from gateway.client.robust import Backoff

__all__ = [
    "DEFAULT_URL",
    "Backoff",
    "BlockingClient",
    "BlockingConsumer",
    "Client",
    "ClientClosed",
    "ClientError",
    "ConnectionLost",
    "Consumer",
    "ConsumerClosed",
    "KeygateError",
    "Message",
    "error_from_code",
]
