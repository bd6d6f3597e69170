"""Publishers written as users of an active/standby pair write them: each lists every
gateway, publishes one message at a time, records a message only once its gateway
confirmed it (PUBACK, publisher confirm, RECEIPT), and on a lost link connects to the next
address and sends the unconfirmed message again (so a message may be stored twice, never
lost). Blocking clients (paho-mqtt, pika, stomp.py): run each in a worker thread until
``Run.stop`` is set.

Message ``i`` of publisher ``name`` has payload ``name:i`` and key ``name-(i % KEYS)``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as paho
import pika
import pika.exceptions
import stomp
import stomp.exception
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

HOST = "127.0.0.1"
KEYS = 3
# How long a publisher waits for one confirm before it treats the link as lost.
CONFIRM_TIMEOUT = 10.0


@dataclass
class Run:
    """One publisher's addresses, its stop signal, its deadline and what was confirmed."""

    name: str
    ports: list[int]
    stop: threading.Event
    deadline: float  # time.monotonic() after which the publisher fails the test
    confirmed: list[bytes] = field(default_factory=list)

    def message(self) -> tuple[bytes, str]:
        """The next message to send (the first one not confirmed yet) and its key."""
        i = len(self.confirmed)
        return f"{self.name}:{i}".encode(), f"{self.name}-{i % KEYS}"

    def reconnect_pause(self) -> None:
        assert time.monotonic() < self.deadline, f"{self.name} never reached a gateway"
        time.sleep(0.05)  # the user's reconnect backoff, not a test synchronisation


def sequence(payload: bytes) -> tuple[str, int]:
    """(publisher name, i) of a payload sent by one of these publishers."""
    name, _, i = payload.decode().rpartition(":")
    return name, int(i)


class _PahoLink:
    """One paho-mqtt 2.x (MQTT 5) connection, with its PUBACK reason codes by mid."""

    def __init__(self, client_id: str) -> None:
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=paho.MQTTv5,
            reconnect_on_failure=False,
        )
        self.cond = threading.Condition()
        self.connected = False
        self.lost = False
        self.acks: dict[int, int] = {}
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_publish = self._on_publish

    def _on_connect(self, _c: Any, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        with self.cond:
            self.connected = not reason.is_failure
            self.lost = reason.is_failure
            self.cond.notify_all()

    def _on_disconnect(self, *_: Any) -> None:
        with self.cond:
            self.lost = True
            self.cond.notify_all()

    def _on_publish(self, _c: Any, _u: Any, mid: int, reason: Any, _p: Any) -> None:
        with self.cond:
            self.acks[mid] = int(reason.value)
            self.cond.notify_all()

    def wait_connected(self) -> bool:
        with self.cond:
            self.cond.wait_for(lambda: self.connected or self.lost, CONFIRM_TIMEOUT)
            return self.connected and not self.lost

    def wait_ack(self, mid: int) -> int | None:
        """The PUBACK's reason code; None when the link broke first."""
        with self.cond:
            self.cond.wait_for(lambda: mid in self.acks or self.lost, CONFIRM_TIMEOUT)
            return self.acks.get(mid)


def paho_publisher(run: Run) -> None:
    """paho-mqtt, MQTT 5, QoS 1 to ``orders/<name>``, the key as the JMSXGroupID user
    property. paho reconnects to one host only: the loop moves to the next address."""
    attempt = 0
    while not run.stop.is_set():
        link = _PahoLink(f"failover-{run.name}")
        port = run.ports[attempt % len(run.ports)]
        attempt += 1
        try:
            link.client.connect(HOST, port, keepalive=5)
        except OSError:
            run.reconnect_pause()
            continue
        link.client.loop_start()
        try:
            if not link.wait_connected():
                continue
            while not run.stop.is_set():
                payload, key = run.message()
                properties = Properties(PacketTypes.PUBLISH)
                properties.UserProperty = [("JMSXGroupID", key)]
                info = link.client.publish(f"orders/{run.name}", payload, 1, properties=properties)
                reason = link.wait_ack(info.mid)
                if reason is None:
                    break  # lost with the gateway: connect to the next one, send it again
                if reason < 0x80:
                    run.confirmed.append(payload)
        finally:
            link.client.disconnect()
            link.client.loop_stop()


def pika_publisher(run: Run) -> None:
    """pika with every gateway's parameters (tried in turn), publisher confirms on, the key
    as the JMSXGroupID header, straight to queue ``orders``."""
    parameters = [
        pika.ConnectionParameters(HOST, port, connection_attempts=1, socket_timeout=5)
        for port in run.ports
    ]
    while not run.stop.is_set():
        try:
            connection = pika.BlockingConnection(parameters)
        except pika.exceptions.AMQPConnectionError:
            run.reconnect_pause()
            continue
        try:
            channel = connection.channel()
            channel.confirm_delivery()
            while not run.stop.is_set():
                payload, key = run.message()
                properties = pika.BasicProperties(headers={"JMSXGroupID": key})
                channel.basic_publish("", "orders", payload, properties)
                run.confirmed.append(payload)
        except (pika.exceptions.AMQPError, OSError):
            continue  # lost with the gateway (or nacked): reconnect, send it again
        finally:
            with contextlib.suppress(pika.exceptions.AMQPError, OSError):
                if connection.is_open:
                    connection.close()


class _Receipts(stomp.ConnectionListener):  # type: ignore[misc]
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.receipts: set[str] = set()
        self.lost = False

    def on_receipt(self, frame: Any) -> None:
        with self.cond:
            self.receipts.add(frame.headers["receipt-id"])
            self.cond.notify_all()

    def on_error(self, frame: Any) -> None:
        self.on_disconnected()  # the gateway closes the connection after an ERROR

    def on_disconnected(self) -> None:
        with self.cond:
            self.lost = True
            self.cond.notify_all()

    def wait(self, receipt: str) -> bool:
        with self.cond:
            self.cond.wait_for(lambda: receipt in self.receipts or self.lost, CONFIRM_TIMEOUT)
            return receipt in self.receipts


def stomp_publisher(run: Run) -> None:
    """stomp.py (STOMP 1.2) with every gateway's (host, port), which it tries in turn on
    connect; a SEND with a receipt header, the key as JMSXGroupID, to ``/queue/orders``."""
    hosts = [(HOST, port) for port in run.ports]
    sends = 0
    while not run.stop.is_set():
        # Users pass reconnect_attempts_max=-1 (for ever); bounded here by the deadline.
        conn = stomp.Connection12(hosts, reconnect_attempts_max=400, reconnect_sleep_max=0.25)
        receipts = _Receipts()
        conn.set_listener("receipts", receipts)
        try:
            conn.connect(wait=True)
            while not run.stop.is_set():
                payload, key = run.message()
                sends += 1
                receipt = f"r-{sends}"
                conn.send(
                    "/queue/orders", payload, headers={"JMSXGroupID": key, "receipt": receipt}
                )
                if not receipts.wait(receipt):
                    break  # lost with the gateway: connect to the next one, send it again
                run.confirmed.append(payload)
        except (stomp.exception.StompException, OSError):
            run.reconnect_pause()
        finally:
            with contextlib.suppress(stomp.exception.StompException, OSError):
                conn.disconnect()


__all__ = [
    "KEYS",
    "Run",
    "paho_publisher",
    "pika_publisher",
    "sequence",
    "stomp_publisher",
]
