"""What the gateway does for the frames of one STOMP connection, in the order they came.

How it works. The listener's reader hands CONNECT to ``connect`` (nothing may follow it
until it is accepted) and every other event to ``put``, which queues it in a
``protocols._queue.WorkQueue`` (bounded: when it is full the reader stops reading). The
worker, ``run``, takes the events in order:

- a run of consecutive plain SENDs that piled up while the previous write was committing
  is stored with one ``publish_in_order`` call (one ``Sink.publish_many``), so the reader
  never waits for a commit before reading the next frame while the store order is the
  send order. RECEIPTs go out after the call returned, i.e. after commit; if one SEND is
  refused, those before it are stored and receipted and it gets the ERROR;
- COMMIT is one ``Sink.publish_many`` of the transaction's SENDs (all or none), then its
  ACKs and NACKs;
- SUBSCRIBE binds a flow through the sink with a ``_Subscriber`` as its output,
  UNSUBSCRIBE unbinds it, ACK and NACK settle it (DESIGN.md §5b).

Every failure becomes an ERROR frame written after the work queued before it, and then
``run`` returns: the connection ends. So does DISCONNECT, after its RECEIPT, and the
``End`` marker ``stop`` queues when the client went away.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Final, TypeAlias

from core.actions import Deliver
from core.errors import KeygateError, Unavailable
from core.model import AckMode
from protocols import sink as settles
from protocols._io import FlowGate, Outbox, publish_in_order, tell_backpressure
from protocols._limits import Admission, publication_bytes
from protocols._log import ConnectionLog
from protocols._queue import WorkQueue
from protocols.sink import BindRequest, Principal, Sink
from protocols.stomp.connection import ServerConnection
from protocols.stomp.events import (
    Commit,
    Connect,
    Disconnect,
    Publish,
    ReceiptRequest,
    Settle,
    Subscribe,
    Unsubscribe,
)

MAX_PENDING_OPS: Final = 4096
MAX_BATCH: Final = 1024
MAX_BATCH_BYTES: Final = 4 * 1024 * 1024


class Fatal:
    """Queue marker: write this ERROR after everything queued before it, then close."""

    __slots__ = ("error", "receipt")

    def __init__(self, error: KeygateError, receipt: str | None = None) -> None:
        self.error = error
        self.receipt = receipt


class End:
    """Queue marker: the client went away; finish what is queued and close."""

    __slots__ = ()


Op: TypeAlias = (
    Publish | Commit | ReceiptRequest | Disconnect | Subscribe | Unsubscribe | Settle | Fatal | End
)


def _size(op: Op) -> int:
    # Headers count: a SEND of small body and 64 KiB of headers is not free.
    if isinstance(op, Publish):
        return publication_bytes(op.publication)
    if isinstance(op, Commit):
        return sum(publication_bytes(p) for p in op.publications)
    return 0


def _batchable(op: Op) -> bool:
    return isinstance(op, Publish)


class _Subscriber:
    """``protocols.sink.FlowOutput`` of one SUBSCRIBE (DESIGN.md §5b).

    The group runtime pushes deliveries here; each becomes a MESSAGE frame in the
    connection's outbox. ``ack:auto`` deliveries are acked once the socket took them
    (``Outbox``), so the window bounds what a slow reader holds. A delivery the frame
    cannot carry is handed back (dead-lettered as undeliverable). One that arrives after
    the client's UNSUBSCRIBE was read, before the worker unbound the flow, is not written
    and not handed back: the unbind returns it for redelivery, as for any closed flow,
    and a message it does not hold is not acked. When the queue is
    deleted the connection gets an ERROR and ends, as a STOMP server reports a failed
    subscription.
    """

    def __init__(self, session: Session, subscription: str, serial: int, auto: bool) -> None:
        self.session = session
        self.subscription = subscription
        self.serial = serial
        self.auto = auto
        self.flow_id = ""
        self.gate = FlowGate(session.outbox, self._backpressure)

    def deliver(self, deliveries: Sequence[Deliver]) -> Sequence[Deliver]:
        sent: list[str] = []
        failed: list[Deliver] = []
        conn = self.session.conn
        for delivery in deliveries:
            try:
                if not conn.message(self.subscription, self.serial, delivery):
                    continue
            except (KeygateError, ValueError):
                failed.append(delivery)
                continue
            sent.append(delivery.message.message_id)
        auto_acked = (self.flow_id, sent) if self.auto else None
        self.gate.check()
        self.session.outbox.push(conn.data_to_send(), auto_acked)
        return failed

    def _backpressure(self, on: bool) -> None:
        tell_backpressure(self.session.sink, self.session.principal, self.flow_id, on)

    def partitions_changed(self, partitions: frozenset[int]) -> None:
        """STOMP has no frame for it: a consumer sees its partitions in ``x-partition``."""

    def terminate(self, error: KeygateError) -> None:
        self.session.flows.pop(self.subscription, None)
        self.session.conn.subscriptions.forget(self.subscription)
        self.session.queue.put_nowait(Fatal(error))


class Session:
    """One connection's login, flows and ordered work (see the module doc)."""

    def __init__(
        self,
        sink: Sink,
        conn: ServerConnection,
        outbox: Outbox,
        *,
        identity: tuple[str | None, str | None],
        admission: Admission,
        max_unconfirmed_bytes: int,
        log: ConnectionLog,
        peer: str,
    ) -> None:
        self.sink = sink
        self.conn = conn
        self.outbox = outbox
        self.queue: WorkQueue[Op] = WorkQueue(
            max_items=MAX_PENDING_OPS,
            max_bytes=max_unconfirmed_bytes,
            max_batch=MAX_BATCH,
            max_batch_bytes=MAX_BATCH_BYTES,
            batchable=_batchable,
            size=_size,
        )
        self.principal = Principal(None, "stomp")
        self.session_id = secrets.token_hex(8)
        # Subscription id -> the flow it bound.
        self.flows: dict[str, str] = {}
        self._identity = identity
        self._admission = admission
        self._log = log
        self._peer = peer

    async def put(self, op: Op) -> None:
        """Queue an event for the worker, waiting while the queue is full."""
        await self.queue.put(op)

    def stop(self) -> None:
        """The client went away: what is already queued is still stored and confirmed."""
        self.queue.put_nowait(End())

    def settle_written(self, flow_id: str, message_ids: tuple[str, ...]) -> None:
        self.sink.settle(self.principal, flow_id, settles.Ack(message_ids))

    def unbind_all(self) -> None:
        """The connection ends: its flows' unacked messages go back for redelivery and
        their partitions are kept for them through the rebalance delay."""
        for flow_id in self.flows.values():
            self.sink.settle(self.principal, flow_id, settles.Unbind())
        self.flows.clear()

    async def connect(self, event: Connect) -> bool:
        """Authenticate and answer CONNECTED; False (an ERROR is queued) when refused."""
        peer, certificate_user = self._identity
        try:
            self.principal = await self.sink.authenticate(
                event.login,
                event.passcode,
                protocol="stomp",
                client_id=event.client_id or self.session_id,
                peer=peer,
                certificate_user=certificate_user,
            )
            self._log.authenticated(self.principal)
            self._admission.login(self.principal.username)
        except KeygateError as e:  # ConnectionLimitReached included
            self._log.info("stomp %s: CONNECT refused: %s", self._peer, e.message)
            await self.put(Fatal(e))
            return False
        self.conn.connected(self.session_id)
        await self._flush()
        return True

    async def run(self) -> None:
        """The worker: do what is queued, in order, until the connection must end."""
        while True:
            batch = await self.queue.take()
            op = batch[0]
            if isinstance(op, Publish):
                if not await self._store(batch):
                    return
            elif isinstance(op, Commit):
                if not await self._commit(op):
                    return
            elif isinstance(op, Subscribe | Unsubscribe | Settle):
                if not await self._consume(op):
                    return
            elif isinstance(op, ReceiptRequest):
                await self._receipt(op.receipt)
            elif isinstance(op, Disconnect):
                await self._receipt(op.receipt)
                return
            elif isinstance(op, Fatal):
                self.conn.error(op.error, op.receipt)
                await self._flush()
                return
            else:
                return

    async def _store(self, batch: list[Op]) -> bool:
        sends = [op for op in batch if isinstance(op, Publish)]
        outcomes = await publish_in_order(
            self.sink,
            self.principal,
            [s.publication for s in sends],
            stop_at_refusal=True,
            log=self._log,
        )
        for index, (send, outcome) in enumerate(zip(sends, outcomes, strict=False)):
            if outcome is not None:
                # The ERROR names a receipt: this SEND's, or the next one that asked.
                later = (s.receipt for s in sends[index:] if s.receipt is not None)
                return await self._fail(outcome, next(later, None))
            if send.receipt is not None:
                self.conn.receipt(send.receipt)
        await self._flush()
        return True

    async def _commit(self, commit: Commit) -> bool:
        try:
            if commit.publications:  # atomically: all of the transaction or none
                await self.sink.publish_many(self.principal, list(commit.publications))
        except KeygateError as e:
            return await self._fail(e, commit.receipt)
        except Exception:
            self._log.exception("stomp %s: COMMIT failed unexpectedly", self._peer)
            return await self._fail(Unavailable("internal server error"), commit.receipt)
        for settle in commit.settles:
            self._settle(settle)
        await self._receipt(commit.receipt)
        return True

    async def _consume(self, op: Subscribe | Unsubscribe | Settle) -> bool:
        """Bind, unbind or settle a subscription's flow; RECEIPT after it took effect."""
        try:
            if isinstance(op, Subscribe):
                await self._subscribe(op)
            elif isinstance(op, Unsubscribe):
                flow_id = self.flows.pop(op.subscription, None)
                if flow_id is not None:
                    self.sink.settle(self.principal, flow_id, settles.Unbind())
            else:
                self._settle(op)
        except KeygateError as e:
            return await self._fail(e, op.receipt)
        await self._receipt(op.receipt)
        return True

    async def _subscribe(self, op: Subscribe) -> None:
        subscriber = _Subscriber(self, op.subscription, op.serial, auto=op.ack == "auto")
        result = await self.sink.bind(
            self.principal,
            BindRequest(
                queue=op.queue,
                group=op.group,
                client=f"stomp:{self.principal.client_id or self.session_id}",
                window=op.prefetch,
                ack_mode=AckMode.AUTO if subscriber.auto else AckMode.CLIENT,
            ),
            subscriber,
        )
        subscriber.flow_id = result.flow_id
        self.flows[op.subscription] = result.flow_id
        self._log.info(
            "stomp %s: subscription %s is flow %s of %s/%s",
            self._peer,
            op.subscription,
            result.flow_id,
            op.queue,
            op.group,
            extra={"flow": result.flow_id, "queue": op.queue, "group": op.group},
        )

    def _settle(self, op: Settle) -> None:
        flow_id = self.flows.get(op.subscription)
        if flow_id is None:
            return  # unsubscribed meanwhile: its messages went back for redelivery
        event = settles.Ack(op.message_ids) if op.ack else settles.Nack(op.message_ids)
        self.sink.settle(self.principal, flow_id, event)

    async def _receipt(self, receipt: str | None) -> None:
        if receipt is not None:
            self.conn.receipt(receipt)
            await self._flush()

    async def _fail(self, error: KeygateError, receipt: str | None) -> bool:
        self._log.info("stomp %s: %s: %s", self._peer, error.code, error.message)
        self.conn.error(error, receipt)
        await self._flush()
        return False

    async def _flush(self) -> None:
        """Hand the connection's frames to the outbox, waiting while it is full (a client
        that does not read slows its own connection down, not the gateway)."""
        data = self.conn.data_to_send()
        if data:
            await self.outbox.put(data)


__all__ = ["End", "Fatal", "Op", "Session"]
