"""A TCP proxy between a client and the gateway that can cut the network, for tests.

``cut()`` resets every proxied connection on both sides (SO_LINGER 0, so each peer sees
an RST, as after a router or NAT failure) and refuses new connections — each is accepted
and reset at once — until ``restore()``. ``refused`` counts the connections refused, so
a test can wait until a client has tried to come back before letting it through.
``freeze()`` is the silent failure instead (a black hole): nothing more is forwarded
either way and new connections are accepted and left hanging, until ``restore()``;
``held_back`` counts what was read meanwhile and not forwarded (chunks of either side).
``cut(answer=...)`` hands each new connection to ``answer`` instead of resetting it: a
server that is up but refuses sessions (tests.support.postgres.not_accepting_connections).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Final

_LINGER_RESET: Final = struct.pack("ii", 1, 0)
_CHUNK: Final = 65536

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    writer.transport.abort()


class TcpProxy:
    """``async with TcpProxy(port) as proxy``: listens on ``proxy.port`` (loopback)."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self._target = (target_host, target_port)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._refusing = False
        self._answer: Answer | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._held: list[asyncio.StreamWriter] = []
        self.refused = 0
        self.held_back = 0
        self.port = 0

    async def __aenter__(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self._writers.update(self._held)
        self._reset_all()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        return f"keygate://127.0.0.1:{self.port}"

    def cut(self, answer: Answer | None = None) -> None:
        """Reset every connection (both sides) and refuse new ones until ``restore()``:
        reset at once, or, with ``answer``, handed to it (it closes them when done)."""
        self._refusing = True
        self._answer = answer
        self._reset_all()

    def freeze(self) -> None:
        """Forward nothing more and leave new connections hanging until ``restore()``."""
        self._flowing.clear()

    def restore(self) -> None:
        self._refusing = False
        self._answer: Answer | None = None
        self._flowing.set()

    def _reset_all(self) -> None:
        for writer in list(self._writers):
            _reset(writer)
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing:
            self.refused += 1
            if self._answer is None:
                _reset(writer)
                return
            try:
                await self._answer(reader, writer)
                writer.close()
                await writer.wait_closed()
            except (ConnectionError, OSError, asyncio.IncompleteReadError):
                writer.transport.abort()
            return
        if not self._flowing.is_set():
            self._held.append(writer)  # accepted, never answered
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            _reset(writer)
            return
        self._writers.update((writer, up_writer))
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(_CHUNK):
                if not self._flowing.is_set():
                    self.held_back += 1
                    await self._flowing.wait()
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            # One side ended or was reset: the other side sees it the same way.
            if dst in self._writers:
                self._writers.discard(dst)
                _reset(dst)


__all__ = ["TcpProxy"]
