"""MQTT QoS 1 publish throughput: keygate's listener against Mosquitto, same run.

Not a test. One paho-mqtt 2.x client per target publishes ``--messages`` QoS 1 messages
of ``--size`` bytes to ``--topic`` with up to ``--inflight`` unacknowledged at once
(``max_inflight_messages_set``) and stops the clock at the last PUBACK: for keygate a
PUBACK means the message is committed. The client runs in a child process and is the same
for every target. paho itself tops out at a few thousand messages a second, so
``--client raw`` (keygate's codec as a lean asyncio client) shows what the servers can do;
with it, ``--connections N`` publishes from N connections at once (devices), each with its
own ``--inflight`` window and its share of ``--messages``.

    python -m benchmarks.mqtt --self-contained              # listener + no-op sink in-process
    python -m benchmarks.mqtt --keygate 127.0.0.1:1884      # a running gateway; a queue must
                                                            # subscribe to --topic
    python -m benchmarks.mqtt --mosquitto 127.0.0.1:1883
    python -m benchmarks.mqtt --keygate 127.0.0.1:1884 --client raw --connections 100 \
        --inflight 10                                       # many devices, small windows

Without a target it runs ``--self-contained`` and, when 127.0.0.1:1883 accepts a
connection, Mosquitto there as well. When keygate (or the self-contained listener) and
Mosquitto both ran, the ratio keygate / Mosquitto is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import multiprocessing
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from benchmarks.cpu import cpu_per_100k, cpu_text, find_pid
from benchmarks.nullsink import NullSink
from protocols.mqtt import ConnAck, Connect, MqttCodec, MqttListener, PubAck, Publish

MOSQUITTO_DEFAULT = "127.0.0.1:1883"
# Packet ids of one connection (paho queues every publish of a run at once, by its id).
MAX_PAHO_MESSAGES = 65_535


@dataclass(frozen=True)
class Result:
    target: str
    messages: int
    seconds: float
    refused: int
    cpu_per_100k: float | None = None  # the server's, when its pid is known

    @property
    def rate(self) -> float:
        return self.messages / self.seconds

    def __str__(self) -> str:
        return (
            f"{self.target:<28} {self.messages:>8} msgs {self.seconds:8.2f} s "
            f"{self.rate:>10,.0f} msg/s  refused {self.refused}{cpu_text(self.cpu_per_100k)}"
        )


def run_paho(
    target: str,
    address: str,
    *,
    topic: str,
    messages: int,
    size: int,
    inflight: int,
    version: int,
    timeout: float = 600.0,
) -> Result:
    """Publish ``messages`` at QoS 1 and wait for every PUBACK (blocks)."""
    host, _, port = address.rpartition(":")
    client = paho.Client(
        CallbackAPIVersion.VERSION2,
        client_id=f"kg-bench-{uuid.uuid4().hex[:8]}",
        protocol=paho.MQTTv5 if version == 5 else paho.MQTTv311,
        reconnect_on_failure=False,
    )
    client.max_inflight_messages_set(inflight)
    connected, done = threading.Event(), threading.Event()
    acked = refused = 0

    def on_connect(client: Any, userdata: Any, flags: Any, rc: Any, props: Any) -> None:
        if rc != 0:
            raise SystemExit(f"{target}: CONNACK {rc}")
        connected.set()

    def on_publish(client: Any, userdata: Any, mid: int, rc: Any, props: Any) -> None:
        nonlocal acked, refused
        acked += 1
        refused += rc.is_failure
        if acked == messages:
            done.set()

    client.on_connect = on_connect
    client.on_publish = on_publish
    client.connect(host, int(port), keepalive=60)
    client.loop_start()
    try:
        if not connected.wait(10):
            raise SystemExit(f"{target}: no CONNACK from {address}")
        payload = b"x" * size
        start = time.perf_counter()
        for _ in range(messages):
            client.publish(topic, payload, 1)
        if not done.wait(timeout):
            raise SystemExit(f"{target}: only {acked}/{messages} PUBACKs in {timeout} s")
        elapsed = time.perf_counter() - start
    finally:
        client.disconnect()
        client.loop_stop()
    return Result(target, messages, elapsed, refused)


class RawClient:
    """One connected client of ``--client raw``: keygate's codec over an asyncio stream."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, codec: MqttCodec
    ) -> None:
        self._reader, self._writer, self._codec = reader, writer, codec

    @classmethod
    async def connect(cls, address: str, version: int) -> RawClient:
        host, _, port = address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        codec = MqttCodec(version=version)
        writer.write(codec.send(Connect(f"kg-raw-{uuid.uuid4().hex[:8]}", version)))
        while not isinstance(codec.next_event(), ConnAck):
            codec.receive_data(await reader.read(65536))
        return cls(reader, writer, codec)

    async def publish(self, messages: int, *, topic: str, size: int, inflight: int) -> int:
        """Publish ``messages`` at QoS 1, up to ``inflight`` unacknowledged; how many
        were refused, after the last PUBACK."""
        reader, writer, codec = self._reader, self._writer, self._codec
        acked = refused = 0
        window = asyncio.Semaphore(inflight)

        async def read_acks() -> None:
            nonlocal acked, refused
            while acked < messages:
                data = await reader.read(65536)
                if not data:
                    raise SystemExit(f"connection closed after {acked} acks")
                codec.receive_data(data)
                while (packet := codec.next_event()) is not None:
                    if isinstance(packet, PubAck):
                        acked += 1
                        refused += packet.reason_code >= 0x80
                        window.release()

        acks = asyncio.create_task(read_acks())
        payload = b"x" * size
        for index in range(messages):
            await window.acquire()
            writer.write(codec.send(Publish(topic, payload, 1, packet_id=index % 65535 + 1)))
            if index % 64 == 0:
                await writer.drain()
        await acks
        return refused

    def close(self) -> None:
        self._writer.close()


async def publish_from(clients: Sequence[RawClient], messages: int, **kwargs: Any) -> int:
    """``clients`` publish their shares of ``messages`` at once; how many were refused."""
    count = len(clients)
    shares = [messages // count + (i < messages % count) for i in range(count)]
    outcomes = await asyncio.gather(
        *(client.publish(share, **kwargs) for client, share in zip(clients, shares, strict=True))
    )
    return sum(outcomes)


async def raw_publish(
    target: str, address: str, *, messages: int, connections: int, version: int, **kwargs: Any
) -> Result:
    """``connections`` clients connect first, then publish their shares of ``messages``
    at once; the clock runs from the first publish to the last PUBACK."""
    clients = [await RawClient.connect(address, version) for _ in range(connections)]
    start = time.perf_counter()
    refused = await publish_from(clients, messages, **kwargs)
    elapsed = time.perf_counter() - start
    for client in clients:
        client.close()
    return Result(target, messages, elapsed, refused)


def run_raw(target: str, address: str, **kwargs: Any) -> Result:
    """Like ``run_paho`` with keygate's own codec as a lean asyncio client (blocks)."""
    return asyncio.run(raw_publish(target, address, **kwargs))


async def run_client(
    target: str, address: str, *, server_pid: int | None = None, **kwargs: Any
) -> Result:
    """Run the client in a child process, so it never shares our GIL or event loop; with
    ``server_pid``, also the server's CPU time per 100k messages."""
    loop = asyncio.get_running_loop()
    context = multiprocessing.get_context("spawn")
    client = run_raw if kwargs.pop("client") == "raw" else run_paho
    with ProcessPoolExecutor(1, mp_context=context) as pool:
        run = loop.run_in_executor(pool, partial(client, target, address, **kwargs))
        result, cpu = await cpu_per_100k(server_pid, kwargs["messages"], run)
    return dataclasses.replace(result, cpu_per_100k=cpu)


async def self_contained(**kwargs: Any) -> Result:
    listener = MqttListener(NullSink(), receive_maximum=max(1024, kwargs["inflight"]))
    port = await listener.start("127.0.0.1", 0, None)
    try:
        return await run_client("keygate (self-contained)", f"127.0.0.1:{port}", **kwargs)
    finally:
        await listener.close()


def _answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


async def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--keygate", metavar="HOST:PORT")
    parser.add_argument("--mosquitto", metavar="HOST:PORT")
    parser.add_argument("--keygate-pid", type=int, help="the keygate process, for CPU time")
    parser.add_argument("--mosquitto-pid", type=int, help="default: found by name")
    parser.add_argument("--self-contained", action="store_true")
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--inflight", type=int, default=1000, help="per connection")
    parser.add_argument(
        "--connections",
        type=int,
        default=1,
        help="raw client only: this many connections (devices), each --inflight, sharing"
        " --messages",
    )
    parser.add_argument("--topic", default="bench/mqtt")
    parser.add_argument("--mqtt-version", type=int, choices=(4, 5), default=5)
    parser.add_argument(
        "--client",
        choices=("paho", "raw"),
        default="paho",
        help="raw: keygate's codec as a lean asyncio client, to measure the server, not paho",
    )
    args = parser.parse_args(argv)
    if args.client == "paho" and args.messages > MAX_PAHO_MESSAGES:
        # paho numbers every publish when it is queued and keeps the queued ones by that
        # number: past 65,535 queued at once a number comes round again, the message it
        # named is lost from the queue and the run waits for a PUBACK that never comes
        # (seen with Mosquitto as with keygate).
        parser.error(f"--messages: at most {MAX_PAHO_MESSAGES:,} with paho")
    if args.client == "paho" and args.connections != 1:
        parser.error("--connections: with --client raw")
    mosquitto = args.mosquitto
    standalone = args.self_contained
    if not (args.keygate or mosquitto or standalone):
        standalone = True
        mosquitto = MOSQUITTO_DEFAULT if _answers(MOSQUITTO_DEFAULT) else None
    options: dict[str, Any] = {
        "topic": args.topic,
        "messages": args.messages,
        "size": args.size,
        "inflight": args.inflight,
        "version": args.mqtt_version,
        "client": args.client,
    }
    if args.client == "raw":
        options["connections"] = args.connections
    results: dict[str, Result] = {}
    if standalone:
        results["self"] = await self_contained(**options)
        print(results["self"])
    if args.keygate:
        results["keygate"] = await run_client(
            "keygate", args.keygate, server_pid=args.keygate_pid, **options
        )
        print(results["keygate"])
    if mosquitto:
        pid = args.mosquitto_pid or find_pid("mosquitto")
        results["mosquitto"] = await run_client("mosquitto", mosquitto, server_pid=pid, **options)
        print(results["mosquitto"])
        for key in ("keygate", "self"):
            if key in results:
                ratio = results[key].rate / results["mosquitto"].rate
                print(f"ratio {results[key].target} / mosquitto = {ratio:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
