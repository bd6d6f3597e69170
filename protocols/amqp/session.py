"""What the gateway does for the events of one AMQP connection, in the order they came.

How it works. The listener's reader queues every event the sans-IO ``AmqpConnection``
yields in a ``protocols._queue.WorkQueue``; ``run``, the worker, performs them in exactly
that order and reports each result back to the connection (``authenticated``,
``operation_done``, ``published``), which produces the replies that ``flush`` hands to
the outbox:

- a run of consecutive Publishes (everything that arrived while the previous batch was
  committing) is stored with one ``publish_in_order`` call — one transaction, in arrival
  order, each publication stored or refused alone, so only the refused messages are
  nacked; a failed write nacks the whole batch (nothing of it was stored). One batch at
  a time keeps the connection's messages in the order sent;
- queue declare, delete, purge, bind and unbind go to the sink; consumers (consume,
  cancel, get, ack, ...) to ``protocols.amqp.flows``, so a cancel or an ack never
  overtakes the consume it belongs to.

Exchanges a read declared or deleted are stored (``save_exchanges``) before the replies
of that read leave: until then ``flush`` holds them, with the no_ack deliveries among
them. A bug of ours in an operation closes the connection with 541, never the server.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Final, TypeAlias

from core.errors import (
    InvalidArgument,
    KeygateError,
    PermissionDenied,
    QueueNotFound,
    StorageError,
    Unavailable,
)
from core.model import QueueConfig
from protocols._io import Outbox, publish_in_order
from protocols._limits import Admission, publication_bytes
from protocols._log import ConnectionLog
from protocols._queue import WorkQueue
from protocols.amqp import events as ev
from protocols.amqp.arguments import check_equivalent
from protocols.amqp.connection import AmqpConnection
from protocols.amqp.constants import ReplyCode
from protocols.amqp.errors import AmqpChannelError
from protocols.amqp.flows import ConsumerFlows
from protocols.sink import Principal, Sink

# Stop reading from a connection while this much is queued for the worker.
MAX_PENDING_OPS: Final = 5000
MAX_BATCH: Final = 1000
MAX_BATCH_BYTES: Final = 4 * 1024 * 1024

Op: TypeAlias = ev.Authenticate | ev.Operation | ev.ChannelGone


class _InternalError(KeygateError):
    code = "internal-error"


def _size(op: Op) -> int:
    """The bytes a publish holds: its message's payload, properties and headers
    (``publication_bytes``), so a message of large headers counts as large. One the
    listener refused itself has no publication: its body (none when too large) and its
    headers' text."""
    if not isinstance(op, ev.Publish):
        return 0
    if op.publication is not None:
        return publication_bytes(op.publication)
    headers = op.properties.headers
    return len(op.payload) + (len(repr(headers)) if headers else 0)


def _batchable(op: Op) -> bool:
    return isinstance(op, ev.Publish)


class Session:
    """One connection's login, operations and consumers (see the module doc)."""

    def __init__(
        self,
        sink: Sink,
        connection: AmqpConnection,
        outbox: Outbox,
        *,
        identity: tuple[str | None, str | None],
        admission: Admission,
        log: ConnectionLog,
        peer: object,
    ) -> None:
        self.sink = sink
        self.connection = connection
        self.outbox = outbox
        self.queue: WorkQueue[Op] = WorkQueue(
            max_items=MAX_PENDING_OPS,
            max_bytes=connection.max_unconfirmed_bytes,
            max_batch=MAX_BATCH,
            max_batch_bytes=MAX_BATCH_BYTES,
            batchable=_batchable,
            size=_size,
        )
        self.principal: Principal | None = None
        self._identity = identity
        self._admission = admission
        self.log = log
        self.peer = peer
        self._saving = False
        # no_ack deliveries whose frames wait in the connection while exchanges are saved.
        self._held_acks: list[tuple[str, Sequence[str]]] = []
        self.flows = ConsumerFlows(sink, connection, self.flush, outbox)

    def settle_written(self, flow_id: str, message_ids: tuple[str, ...]) -> None:
        if self.principal is not None:
            self.flows.settle_written(self.principal, flow_id, message_ids)

    def unbind_all(self) -> None:
        if self.principal is not None:
            self.flows.unbind_all(self.principal)

    def flush(self, auto_acked: tuple[str, Sequence[str]] | None = None) -> None:
        """Hand the connection's pending frames to the outbox; ``auto_acked``: the no_ack
        deliveries among them, acked once written."""
        if auto_acked is not None:
            self._held_acks.append(auto_acked)
        if self._saving:
            return  # answers wait until the exchanges they confirm are stored
        self.outbox.push(self.connection.data_to_send())
        for acked in self._held_acks:
            self.outbox.push(b"", acked)
        self._held_acks.clear()

    async def save_exchanges(self) -> None:
        """Store the exchanges this input declared or deleted before answering it."""
        unsaved = self.connection.exchanges.take_unsaved()
        if not unsaved:
            return
        self._saving = True
        try:
            for name, type_name in unsaved.items():
                await self.sink.save_amqp_exchange(name, type_name)
        except KeygateError as e:
            self.log.warning("amqp connection %s: cannot store exchanges: %s", self.peer, e)
            self.connection.close(ReplyCode.INTERNAL_ERROR, f"cannot store the exchange: {e}")
        finally:
            self._saving = False

    async def run(self) -> None:
        """The worker: perform what is queued, in order, for as long as the connection
        lives (the listener ends it)."""
        while True:
            batch = await self.queue.take()
            try:
                if isinstance(batch[0], ev.Publish):
                    publishes = [op for op in batch if isinstance(op, ev.Publish)]
                    self.connection.published(await self._publish(publishes))
                else:
                    await self._perform(batch[0])
            except Exception:
                # A bug of ours must not wedge the connection: fail it, keep the server.
                self.log.exception("amqp connection %s: internal error", self.peer)
                self.queue.clear()
                self.connection.close(ReplyCode.INTERNAL_ERROR, "internal error")
            self.flush()

    async def _authenticate(self, op: ev.Authenticate) -> None:
        peer, certificate_user = self._identity
        try:
            principal = await self.sink.authenticate(
                op.username,
                op.password,
                protocol="amqp",
                client_id=op.client_id,
                peer=peer,
                certificate_user=certificate_user,
            )
            self._admission.login(principal.username)
        except KeygateError as e:  # ConnectionLimitReached included
            self.log.info("amqp login refused for %r from %s: %s", op.username, self.peer, e)
            self.connection.authenticated(e)
            return
        self.principal = principal
        self.log.authenticated(principal)
        admin = self.sink.may_administer(principal)
        self.connection.authenticated(None, admin=admin, username=principal.username)

    async def _perform(self, op: Op) -> None:
        if isinstance(op, ev.Authenticate):
            await self._authenticate(op)
            return
        assert self.principal is not None and not isinstance(op, ev.Publish)
        if isinstance(op, ev.ChannelGone | ev.Consume | ev.Cancel | ev.SettleDeliveries | ev.Get):
            await self.flows.perform(self.principal, op)
            return
        if not self.connection.is_current(op):
            return
        try:
            result = await self._queue_operation(self.principal, op)
        except KeygateError as e:
            self.connection.operation_done(op, 0, e)
        except Exception:
            self.log.exception("amqp operation %r failed", op)
            self.connection.operation_done(op, 0, _InternalError("internal error"))
        else:
            self.connection.operation_done(op, result, None)

    async def _queue_operation(self, principal: Principal, op: ev.Operation) -> int:
        sink = self.sink
        if isinstance(op, ev.DeclareQueue):
            stored = await self._declare(principal, op)
            try:
                return await sink.queue_depth(principal, stored.name)
            except PermissionDenied:
                return 0  # a publisher may declare its queue, not learn its depth
        if isinstance(op, ev.DeleteQueue):
            # Deleting a queue that does not exist is delete-ok, as in RabbitMQ.
            # if-unused is not checked: keygate's consumers are the group's, and a
            # delete ends them all (basic.cancel to AMQP consumers that asked for it).
            try:
                if op.if_empty and await sink.queue_depth(principal, op.queue) > 0:
                    raise AmqpChannelError(
                        ReplyCode.PRECONDITION_FAILED, f"queue '{op.queue}' is not empty", 50, 40
                    )
                return await sink.delete_queue(principal, op.queue)
            except QueueNotFound:
                return 0
        if isinstance(op, ev.PurgeQueue):
            return await sink.purge_queue(principal, op.queue)
        if isinstance(op, ev.BindQueue):
            if not op.unbind:
                assert op.pattern is not None
                await sink.subscribe(principal, op.queue, op.pattern)
            elif op.pattern is not None:
                with contextlib.suppress(QueueNotFound):  # unbind is idempotent (RabbitMQ)
                    await sink.unsubscribe(principal, op.queue, op.pattern)
            return 0
        raise InvalidArgument(f"unexpected operation {op!r}")

    async def _declare(self, principal: Principal, op: ev.DeclareQueue) -> QueueConfig:
        """Passive: the queue or 404. Otherwise an existing queue must match every setting
        the declare names (406 otherwise); a missing one is created."""
        try:
            stored = await self.sink.declare_queue(principal, op.config, passive=True)
        except QueueNotFound:
            if op.passive:
                raise
            return await self.sink.declare_queue(principal, op.config)
        if not op.passive:
            check_equivalent(stored, op.config, op.given)
        return stored

    async def _publish(
        self, batch: list[ev.Publish]
    ) -> list[tuple[ev.Publish, KeygateError | None]]:
        """Store the publications of ``batch`` the connection did not refuse itself; one
        outcome per Publish, in order."""
        assert self.principal is not None
        results: dict[int, KeygateError | None] = {
            index: publish.rejected for index, publish in enumerate(batch)
        }
        todo = [(i, p.publication) for i, p in enumerate(batch) if p.rejected is None]
        publications = [publication for _, publication in todo if publication is not None]
        outcomes = await publish_in_order(
            self.sink, self.principal, publications, stop_at_refusal=False, log=self.log
        )
        for (index, _), outcome in zip(todo, outcomes, strict=True):
            results[index] = outcome
        if any(isinstance(o, StorageError | Unavailable) for o in outcomes):
            self.log.warning("amqp publish of %d messages failed: %s", len(todo), outcomes[0])
        return [(publish, results[index]) for index, publish in enumerate(batch)]


__all__ = ["Op", "Session"]
