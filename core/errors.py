"""keygate's one error tree.

Every error a user or a peer can see is a ``KeygateError`` with a stable ``code`` (the
native protocol's ERROR code, also used in the admin API's JSON). Protocol adapters map
these classes to their own wire codes (AMQP reply codes, MQTT reason codes, STOMP ERROR
frames); protocol-level framing errors are ``ProtocolError`` subclasses that carry the
code their wire needs.

    KeygateError
    ├── InvalidArgument            400  bad name, bad setting, bad request field
    ├── NotFound                   404
    │   ├── QueueNotFound
    │   ├── GroupNotFound
    │   └── KeyNotParked           release of a key that is not parked
    ├── AlreadyExists              409  queue exists with different settings
    ├── Conflict                   409  e.g. group mode/tag mismatch on bind
    │   └── GroupLeased                 the group is held by a Spark job / native flows
    │       └── LeaseLost               a Spark job's lease was taken over while it ran
    ├── PublishRejected            the message was refused, nothing stored
    │   ├── InvalidMessage         400  a field ingress validation refuses (core.ingress)
    │   ├── MessageTooLarge        413
    │   ├── QueueFull              429  max_depth reached
    │   └── NoRoute                404  a topic publish matched no queue
    ├── AuthError
    │   ├── AuthenticationFailed   401
    │   └── PermissionDenied       403
    ├── StorageError               503  the database refused the operation; it did not happen
    │   ├── StorageUnavailable          the database could not be reached (retry later)
    │   ├── SchemaBusy                  the schema needs changing while another gateway is active
    │   ├── SchemaTooNew                the database was migrated by a newer keygate
    │   ├── StorageMisconfigured        the database refuses the URL's user, password or database
    │   └── Fenced                      this gateway lost the gateway lease to another
    ├── Unavailable                503  shutting down / standby gateway
    │   └── ConnectionLimitReached      too many connections in total or for the user
    └── ProtocolError              400  malformed input from a peer (subclassed per protocol)
"""

from __future__ import annotations

from typing import ClassVar, Self


class KeygateError(Exception):
    """Base of every keygate error."""

    code: ClassVar[str] = "error"
    status: ClassVar[int] = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def as_outcome(self) -> Self:
        """This error kept as a value (one publication's refusal among a lot's outcomes)
        rather than raised on: without its traceback and the errors it was raised from.
        A traceback holds the frames it went through and, by ``f_back``, their callers',
        with their locals: a lot's payloads. Once the error also sits in a list one of
        those frames holds, that is a reference cycle, freed only by a full run of the
        cycle collector, which a busy gateway makes rarely."""
        self.__traceback__ = None
        self.__cause__ = self.__context__ = None
        return self


class InvalidArgument(KeygateError):
    code = "invalid-argument"
    status = 400


class NotFound(KeygateError):
    code = "not-found"
    status = 404


class QueueNotFound(NotFound):
    code = "queue-not-found"

    def __init__(self, queue: str) -> None:
        super().__init__(f"queue {queue!r} does not exist")
        self.queue = queue


class GroupNotFound(NotFound):
    code = "group-not-found"

    def __init__(self, queue: str, group: str) -> None:
        super().__init__(f"group {group!r} of queue {queue!r} does not exist")
        self.queue = queue
        self.group = group


class KeyNotParked(NotFound):
    code = "key-not-parked"

    def __init__(self, queue: str, group: str, key: str) -> None:
        super().__init__(f"key {key!r} is not parked in group {group!r} of queue {queue!r}")
        self.queue = queue
        self.group = group
        self.key = key


class AlreadyExists(KeygateError):
    code = "already-exists"
    status = 409


class Conflict(KeygateError):
    code = "conflict"
    status = 409


class GroupLeased(Conflict):
    code = "group-leased"


class GroupLimitReached(Conflict):
    """A bind would create a group beyond the queue's ``max_groups_per_queue``."""

    code = "group-limit"


class LeaseLost(GroupLeased):
    """A Spark job found, when settling, that its group lease had been taken over since it
    took it (it ran past its lease timeout); it settled nothing. Never sent on a wire, so
    it keeps its parent's code."""


class PublishRejected(KeygateError):
    code = "rejected"
    status = 400


class InvalidMessage(PublishRejected):
    code = "invalid-message"
    status = 400


class MessageTooLarge(PublishRejected):
    code = "message-too-large"
    status = 413


class QueueFull(PublishRejected):
    code = "queue-full"
    status = 429


class NoRoute(PublishRejected):
    code = "no-route"
    status = 404


class AuthError(KeygateError):
    code = "auth"
    status = 401


class AuthenticationFailed(AuthError):
    code = "authentication-failed"
    status = 401


class PermissionDenied(AuthError):
    code = "permission-denied"
    status = 403


class StorageError(KeygateError):
    code = "storage-error"
    status = 503


class StorageUnavailable(StorageError):
    code = "storage-unavailable"


class SchemaBusy(StorageError):
    """The schema needs migrating (or its views refreshing) while another gateway holds a
    live gateway lease: nothing was changed. A gateway waits as a standby and migrates
    once it takes the lease (docs/operations.md, "Upgrades")."""

    code = "schema-busy"


class SchemaTooNew(StorageError):
    """The database's schema is at a revision this keygate does not know: a newer keygate
    migrated it. Nothing was changed; run that version (or newer)."""

    code = "schema-too-new"


class StorageMisconfigured(StorageError):
    """The database refused to open a session for the settings it was given: a wrong
    password, an unknown user or database, a pg_hba.conf refusal. Waiting does not heal it
    (the URL must change), so a starting gateway exits with it (status 2). Never sent on
    a wire: clients are told storage-unavailable."""

    code = "storage-misconfigured"


class Fenced(StorageError):
    """A write found that another gateway took the gateway lease over (a newer epoch):
    nothing of it was stored, and this gateway must stop at once."""

    code = "fenced"

    def __init__(self, name: str) -> None:
        super().__init__(f"gateway {name!r} is active elsewhere now; this one was fenced off")
        self.name = name


class Unavailable(KeygateError):
    code = "unavailable"
    status = 503


class ConnectionLimitReached(Unavailable):
    """The gateway's total or the user's connection limit is reached; the login is refused."""

    code = "connection-limit"


class ProtocolError(KeygateError):
    """Malformed or out-of-order input from a peer. Subclasses add the wire's own code."""

    code = "protocol-error"
    status = 400


__all__ = [
    "AlreadyExists",
    "AuthError",
    "AuthenticationFailed",
    "Conflict",
    "ConnectionLimitReached",
    "Fenced",
    "GroupLeased",
    "GroupNotFound",
    "InvalidArgument",
    "InvalidMessage",
    "KeyNotParked",
    "KeygateError",
    "LeaseLost",
    "MessageTooLarge",
    "NoRoute",
    "NotFound",
    "PermissionDenied",
    "ProtocolError",
    "PublishRejected",
    "QueueFull",
    "QueueNotFound",
    "SchemaBusy",
    "SchemaTooNew",
    "StorageError",
    "StorageUnavailable",
    "Unavailable",
]
