"""A pika connection to a test gateway, shared by the AMQP integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pika
from pika.adapters.blocking_connection import BlockingChannel

from gateway.server import Gateway

HOST = "127.0.0.1"


@contextmanager
def pika_channel(
    gateway: Gateway, *, confirm: bool, user: tuple[str, str] = ("guest", "guest")
) -> Iterator[tuple[pika.BlockingConnection, BlockingChannel]]:
    """A pika connection named ``pika-it`` and a channel (in confirm mode when asked);
    the connection is closed however the scenario ends."""
    connection = pika.BlockingConnection(
        pika.ConnectionParameters(
            HOST,
            gateway.ports["amqp"],
            connection_attempts=1,
            client_properties={"connection_name": "pika-it"},
            credentials=pika.PlainCredentials(*user),
        )
    )
    try:
        channel = connection.channel()
        if confirm:
            channel.confirm_delivery()
        yield connection, channel
    finally:
        if connection.is_open:
            connection.close()
