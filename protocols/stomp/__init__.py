"""STOMP 1.0, 1.1 and 1.2 for publishers and consumers: sans-IO codec and connection,
asyncio listener."""

from protocols.stomp.codec import Codec
from protocols.stomp.connection import HEARTBEAT, ServerConnection, State
from protocols.stomp.errors import (
    FrameTooLarge,
    InvalidDestination,
    InvalidFrame,
    StompProtocolError,
    TransactionTooLarge,
    UnsupportedVersion,
    error_message,
)
from protocols.stomp.events import (
    Commit,
    Connect,
    Disconnect,
    Event,
    Publish,
    ReceiptRequest,
    Settle,
    Subscribe,
    Unsubscribe,
)
from protocols.stomp.frames import SUPPORTED_VERSIONS, Frame, Version
from protocols.stomp.listener import StompListener
from protocols.stomp.mapping import publication_from_send

__all__ = [
    "HEARTBEAT",
    "SUPPORTED_VERSIONS",
    "Codec",
    "Commit",
    "Connect",
    "Disconnect",
    "Event",
    "Frame",
    "FrameTooLarge",
    "InvalidDestination",
    "InvalidFrame",
    "Publish",
    "ReceiptRequest",
    "ServerConnection",
    "Settle",
    "State",
    "StompListener",
    "StompProtocolError",
    "Subscribe",
    "TransactionTooLarge",
    "Unsubscribe",
    "UnsupportedVersion",
    "Version",
    "error_message",
    "publication_from_send",
]
