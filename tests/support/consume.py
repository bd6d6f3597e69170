"""Receiving with the SDK in tests."""

from __future__ import annotations

from gateway.client import Consumer, Message


async def take(consumer: Consumer, count: int, *, timeout: float = 10) -> list[Message]:
    """Receive exactly ``count`` messages, acknowledging each."""
    got = []
    for _ in range(count):
        message = await consumer.receive(timeout=timeout)
        got.append(message)
        await consumer.acknowledge(message)
    return got
