"""STOMP publish throughput: keygate's listener against RabbitMQ's STOMP plugin.

Not a test. A single asyncio publisher (keygate's own codec, so the client costs little)
sends ``--messages`` SENDs of ``--size`` bytes to one destination, asking a RECEIPT every
``--receipt-every`` messages, and waits for the last receipt: a receipt means every SEND
before it is durably stored (keygate: committed in SQL; RabbitMQ: ``persistent:true`` and
confirmed). At most ``--window`` receipts may be outstanding, like a JMS producer with a
bounded number of unconfirmed batches.

    python -m benchmarks.stomp --self-contained            # listener + no-op sink in-process
    python -m benchmarks.stomp --keygate 127.0.0.1:61613   # a running gateway (queue must exist)
    python -m benchmarks.stomp --rabbitmq 127.0.0.1:61613  # RabbitMQ with rabbitmq_stomp

Without a target it runs ``--self-contained`` and, when 127.0.0.1:61613 answers STOMP,
RabbitMQ there as well.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass

from benchmarks.cpu import cpu_per_100k, cpu_text, find_pid
from benchmarks.nullsink import NullSink
from protocols.stomp import Codec, Frame, StompListener, Version

RABBITMQ_DEFAULT = "127.0.0.1:61613"


@dataclass(frozen=True)
class Result:
    target: str
    messages: int
    seconds: float
    cpu_per_100k: float | None = None  # the server's, when its pid is known

    def __str__(self) -> str:
        rate = self.messages / self.seconds
        return (
            f"{self.target:<28} {self.messages:>8} msgs {self.seconds:8.2f} s {rate:>10,.0f} msg/s"
            f"{cpu_text(self.cpu_per_100k)}"
        )


async def measured(pid: int | None, messages: int, run: Awaitable[Result]) -> Result:
    """``run``'s result with the server's CPU time per 100k messages (when ``pid``)."""
    result, cpu = await cpu_per_100k(pid, messages, run)
    return dataclasses.replace(result, cpu_per_100k=cpu)


async def _read_frame(reader: asyncio.StreamReader, codec: Codec) -> Frame:
    while (frame := codec.next_event()) is None:
        data = await reader.read(65536)
        if not data:
            raise ConnectionError("server closed the connection")
        codec.receive_data(data)
    if frame.command == "ERROR":
        raise RuntimeError(f"ERROR: {frame.header('message')}: {frame.body!r}")
    return frame


async def publish(
    target: str,
    address: str,
    *,
    destination: str,
    messages: int,
    size: int,
    receipt_every: int,
    window: int,
    login: str | None,
    passcode: str | None,
    extra: tuple[tuple[str, str], ...] = (),
) -> Result:
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    codec = Codec(version=Version.V1_2)
    connect: list[tuple[str, str]] = [("accept-version", "1.2"), ("host", "/")]
    if login is not None:
        connect += [("login", login), ("passcode", passcode or "")]
    writer.write(codec.send(Frame("CONNECT", tuple(connect))))
    await _read_frame(reader, codec)

    body = b"x" * size
    headers = (
        ("destination", destination),
        ("JMSXGroupID", "bench"),
        *extra,
        ("content-length", str(size)),
    )
    plain = codec.send(Frame("SEND", headers, body))
    batches = (messages + receipt_every - 1) // receipt_every
    credit = asyncio.Semaphore(window)
    done = asyncio.Event()

    async def receipts() -> None:
        for _ in range(batches):
            frame = await _read_frame(reader, codec)
            if frame.command == "RECEIPT":
                credit.release()
        done.set()

    started = time.perf_counter()
    reading = asyncio.create_task(receipts())
    sent = 0
    for batch in range(batches):
        count = min(receipt_every, messages - sent)
        await credit.acquire()
        last = codec.send(
            Frame("SEND", (*headers[:-1], ("receipt", str(batch)), headers[-1]), body)
        )
        writer.write(plain * (count - 1) + last)
        sent += count
        await writer.drain()
    await done.wait()
    elapsed = time.perf_counter() - started
    await reading
    writer.write(codec.send(Frame("DISCONNECT")))
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()
    return Result(target, messages, elapsed)


async def answers_stomp(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        async with asyncio.timeout(2):
            reader, writer = await asyncio.open_connection(host, int(port))
            codec = Codec()
            writer.write(
                codec.send(
                    Frame(
                        "CONNECT",
                        (
                            ("accept-version", "1.2"),
                            ("host", "/"),
                            ("login", "guest"),
                            ("passcode", "guest"),
                        ),
                    )
                )
            )
            frame = await _read_frame(reader, codec)
            writer.close()
            return frame.command == "CONNECTED"
    except (OSError, TimeoutError, RuntimeError, ConnectionError):
        return False


def _delete_rabbitmq_queue(name: str) -> None:
    """Best effort: drop the benchmark's queue through AMQP if pika is installed."""
    try:
        import pika

        connection = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1"))
        connection.channel().queue_delete(name)
        connection.close()
    except Exception as e:
        print(f"(could not delete RabbitMQ queue {name!r}: {e})")


async def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keygate", metavar="HOST:PORT")
    parser.add_argument("--rabbitmq", metavar="HOST:PORT")
    parser.add_argument("--keygate-pid", type=int, help="the keygate process, for CPU time")
    parser.add_argument("--rabbitmq-pid", type=int, help="default: beam.smp, found by name")
    parser.add_argument("--self-contained", action="store_true")
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--receipt-every", type=int, default=100)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--queue", default="stomp-bench")
    parser.add_argument("--login")
    parser.add_argument("--passcode")
    args = parser.parse_args(argv)
    common = dict(
        destination=f"/queue/{args.queue}",
        messages=args.messages,
        size=args.size,
        receipt_every=args.receipt_every,
        window=args.window,
    )
    rabbit = args.rabbitmq
    run_self = args.self_contained or not (args.keygate or args.rabbitmq)
    if not (args.keygate or args.rabbitmq or args.self_contained) and await answers_stomp(
        RABBITMQ_DEFAULT
    ):
        rabbit = RABBITMQ_DEFAULT
    print(
        f"{args.messages} x {args.size} B, receipt every {args.receipt_every}, window {args.window}"
    )
    if run_self:
        listener = StompListener(NullSink())
        port = await listener.start("127.0.0.1", 0, None)
        try:
            print(
                await publish(
                    "keygate (no-op sink)", f"127.0.0.1:{port}", login=None, passcode=None, **common
                )
            )
        finally:
            await listener.close()
    if args.keygate:
        run = publish("keygate", args.keygate, login=args.login, passcode=args.passcode, **common)
        print(await measured(args.keygate_pid, args.messages, run))
    if rabbit:
        try:
            run = publish(
                "rabbitmq_stomp (persistent)",
                rabbit,
                login=args.login or "guest",
                passcode=args.passcode or "guest",
                extra=(("persistent", "true"),),
                **common,
            )
            print(await measured(args.rabbitmq_pid or find_pid("beam.smp"), args.messages, run))
        finally:
            _delete_rabbitmq_queue(args.queue)


if __name__ == "__main__":
    asyncio.run(main())
