"""The ``keygate`` command.

keygate serve [--config FILE] [--db URL] [--host H] [--native-port N] ...
keygate queue create|alter|list|show|browse|purge|delete ...  (admin HTTP API, --url)
keygate group create|list|delete|reset QUEUE ...      (admin HTTP API, --url)
keygate key release QUEUE GROUP KEY [--skip|--retry]  (admin HTTP API, --url)
keygate dlq redrive QUEUE.dlq [--to Q] [--limit K] [--where key=K]  (admin HTTP API)
keygate status [--json]                               (admin HTTP API, --url)
keygate inspect QUEUE [--json]                        (admin HTTP API, --url)
keygate publish QUEUE|--topic T PAYLOAD [--delay S] [--ttl S] [--dedup-id ID]
keygate consume QUEUE --group G                       (native protocol, --server)
keygate passwd < password                             (a password hash for [users])
keygate healthcheck [--config FILE] [--active]        (probe this host's /healthz)
keygate demo                                          (a self-contained end-to-end run)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from core.errors import KeygateError, StorageMisconfigured
from core.ingress import MAX_WINDOW
from core.model import GroupMode, KeyOrder, StartPosition
from core.settings import QUEUE_SETTINGS
from gateway import logs
from gateway.admin_commands import (
    DEFAULT_URL,
    CliError,
    group_command,
    inspect_command,
    key_command,
    name_values,
    publish_command,
    queue_command,
    redrive_command,
    status_command,
)
from gateway.config import LISTENERS, ConfigError, load_config
from gateway.server import Gateway


def _serve(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {"db": args.db, "host": args.host, "ports_file": args.ports_file}
    for name in LISTENERS:
        overrides[f"{name}_port"] = getattr(args, f"{name}_port")
    config = load_config(args.config, overrides=overrides)
    logs.configure(config.log_level, as_json=config.log_json)
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        pass
    gateway = Gateway(config)
    runner = asyncio.Runner(loop_factory=loop_factory)
    try:
        runner.run(gateway.serve_forever())
    except StorageMisconfigured as e:
        # The db setting names a user, password or database the server refuses: a bad
        # setting, exit 2, though only the database can tell.
        print(f"keygate: {e.message}", file=sys.stderr)
        return 2
    except KeygateError as e:
        print(f"keygate: {e.message}", file=sys.stderr)
        return 1
    finally:
        # A gateway that stopped without its database (it answered nothing) leaves the
        # tasks still waiting for it: cancelled, they would not end either (asyncpg's
        # cancel request waits on the same link), and closing the loop waits for them.
        if not gateway.left_database:
            runner.close()
    # Exiting non-zero after stopping at once (the lease lost, a critical task ended) lets
    # a supervisor restart us, as a standby if another gateway took over meanwhile.
    return 1 if gateway.failed else 0


def _group_flags(parser: argparse.ArgumentParser) -> None:
    """Settings a group gets when it is created (explicitly, or by its first consumer)."""
    parser.add_argument(
        "--mode",
        choices=[m.value for m in GroupMode],
        help="partitioned (default on a partitioned queue), exclusive or shared",
    )
    parser.add_argument(
        "--key-order",
        dest="key_order",
        choices=[k.value for k in KeyOrder],
        help="partition (default) or strict: at most one unacked message per key",
    )
    parser.add_argument(
        "--start",
        choices=[p.value for p in StartPosition],
        help="where a new group starts: earliest retained message (default) or latest",
    )
    parser.add_argument(
        "--ack-timeout",
        dest="ack_timeout",
        type=float,
        metavar="SECONDS",
        help="redeliver a message left unacked this long (default: never)",
    )
    parser.add_argument(
        "--tag",
        action="append",
        metavar="NAME=VALUE",
        help="tag filter: only messages with this property value",
    )


def _consume(args: argparse.Namespace) -> int:
    from gateway.client import BlockingClient

    try:
        client = BlockingClient(args.server, username=args.user, password=args.password)
    except (OSError, TimeoutError) as e:
        raise CliError(f"cannot reach the gateway at {args.server}: {e}") from e
    with client:
        consumer = client.subscribe(
            args.queue,
            group=args.group,
            window=args.window,
            tags=name_values("--tag", args.tag) or None,
            mode=args.mode,
            key_order=args.key_order,
            start=args.start,
            ack_timeout=args.ack_timeout,
        )
        received = 0
        try:
            while args.count == 0 or received < args.count:
                try:
                    msg = consumer.receive(timeout=args.timeout)
                except TimeoutError:
                    break
                print(
                    json.dumps(
                        {
                            "partition": msg.partition,
                            "seq": msg.seq,
                            "key": msg.key,
                            "message_id": msg.message_id,
                            "delivery_count": msg.delivery_count,
                            "payload": msg.payload.decode("utf-8", "replace"),
                        }
                    ),
                    flush=True,
                )
                consumer.acknowledge(msg)
                received += 1
        finally:
            consumer.close()
    return 0


def _demo(args: argparse.Namespace) -> int:
    from gateway.demo import run_demo

    return asyncio.run(run_demo(messages=args.messages))


def _passwd(args: argparse.Namespace) -> int:
    """Read a password (twice, unechoed, on a terminal; one line from a pipe) and print
    its scrypt hash."""
    from gateway.security import hash_password

    if sys.stdin.isatty():
        import getpass

        password = getpass.getpass("password: ")
        if getpass.getpass("again: ") != password:
            raise CliError("the passwords differ")
    else:
        password = sys.stdin.readline().removesuffix("\n")
    if not password:
        raise CliError("empty password")
    print(hash_password(password))
    return 0


def _healthcheck(args: argparse.Namespace) -> int:
    """Probe this host's own admin API (``/healthz``) on the port the configuration gives:
    plain HTTP if on, else HTTPS — what a container healthcheck needs with TLS on. A
    standby (503, role ``standby``) is healthy: it is waiting for the lease, and restarting
    it would not make it active; ``--active`` asks for the active role."""
    import ssl

    config = load_config(args.config)
    for name, scheme in (("http", "http"), ("http_tls", "https")):
        port = config.port(name)
        if not port or (name == "http_tls" and not config.tls_cert):
            continue
        context = None
        if scheme == "https":
            # Our own listener on loopback; liveness, not identity, is being checked.
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        try:
            with urllib.request.urlopen(
                f"{scheme}://127.0.0.1:{port}/healthz", timeout=args.timeout, context=context
            ):
                return 0
        except urllib.error.HTTPError as e:
            if _role(e) != "standby":
                raise CliError(f"{scheme} port {port}: {e}") from e
            if args.active:
                raise CliError(f"{scheme} port {port}: this gateway is a standby") from e
            return 0
        except (urllib.error.URLError, OSError) as e:
            raise CliError(f"{scheme} port {port}: {e}") from e
    raise CliError("no HTTP or HTTPS listener on a fixed port to probe")


def _role(answer: urllib.error.HTTPError) -> str | None:
    """The role a /healthz error answer names (a standby's 503), if it is one."""
    try:
        role = json.loads(answer.read()).get("role")
    except (ValueError, AttributeError, OSError):
        return None
    return role if isinstance(role, str) else None


def _int_from(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` (to ``high``); anything else is a usage
    error naming the flag (exit 2), as a value that is not an integer already was."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"at least {low}" if high is None else f"between {low} and {high}"
            raise argparse.ArgumentTypeError(f"must be {bound}")
        return value

    return parse


def _credentials(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--user",
        default=os.environ.get("KEYGATE_USER"),
        help="username (default $KEYGATE_USER), when the gateway has users",
    )
    parser.add_argument(
        "--password",
        default=os.environ.get("KEYGATE_PASSWORD"),
        help="password (default $KEYGATE_PASSWORD)",
    )


_METAVARS = {"s": "SECONDS", "bytes": "BYTES", "messages": "N"}


def _queue_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per row of the settings table (core.settings), help text included."""
    parser.add_argument(
        "--subscribe",
        action="append",
        metavar="TOPIC",
        help="topic subscription, MQTT wildcards + and # (repeat for more; alter replaces all)",
    )
    for setting in QUEUE_SETTINGS:
        text = setting.help
        if setting.minimum is not None:
            text += f" ({setting.minimum} to {setting.maximum})"
        if setting.kind is bool:
            parser.add_argument(
                setting.flag, dest=setting.name, action="store_true", default=None, help=text
            )
        else:
            parser.add_argument(
                setting.flag,
                dest=setting.name,
                type=setting.kind,
                metavar=_METAVARS.get(setting.unit, "N" if setting.kind is int else "VALUE"),
                help=text,
            )


def _admin_api(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL, help="admin API URL")
    _credentials(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keygate", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a gateway")
    serve.add_argument("--config", metavar="FILE", help="TOML configuration file")
    serve.add_argument("--db", help="SQLAlchemy URL (default sqlite:///keygate.db)")
    serve.add_argument("--host", help="address to listen on (default 0.0.0.0; :: = IPv6 and IPv4)")
    for name in LISTENERS:
        serve.add_argument(
            f"--{name.replace('_', '-')}-port", help="port, 0 = any free port, off = disabled"
        )
    serve.add_argument("--ports-file", help="write the bound ports as JSON here when ready")
    serve.set_defaults(func=_serve)

    queue = sub.add_parser("queue", help="create, list, show or delete queues")
    queue.add_argument(
        "action",
        choices=["create", "alter", "list", "show", "browse", "purge", "delete"],
        help="what to do (browse shows stored messages without consuming them; purge drops "
        "every message, keeps settings and groups)",
    )
    queue.add_argument("name", nargs="?", help="the queue (every action but list)")
    _admin_api(queue)
    _queue_flags(queue)
    browse = queue.add_argument_group("browse")
    browse.add_argument("--partition", type=_int_from(0), help="browse only this partition")
    browse.add_argument(
        "--from-seq",
        dest="from_seq",
        type=_int_from(0),
        default=0,
        help="first seq to show (default 0)",
    )
    browse.add_argument(
        "--limit", type=_int_from(1), default=100, help="most messages (default 100)"
    )
    browse.add_argument("--json", action="store_true", help="print the messages as JSON")
    queue.set_defaults(func=queue_command)

    group = sub.add_parser("group", help="create, list or delete consumer groups")
    group.add_argument(
        "action",
        choices=["create", "list", "delete", "reset"],
        help="what to do (reset moves the group to --to: replay or skip)",
    )
    group.add_argument("queue", help="the queue the group consumes")
    group.add_argument("name", nargs="?", help="the group (create, delete and reset)")
    group.add_argument(
        "--to",
        metavar="POSITION",
        help="reset position: earliest, latest, seq:P=N,... (first seq to deliver per "
        "partition) or time:ISO8601 (first message published then or later)",
    )
    group.add_argument(
        "--force",
        action="store_true",
        help="reset even with bound consumers: they are rebound at the new position",
    )
    _admin_api(group)
    _group_flags(group)
    group.set_defaults(func=group_command)

    key = sub.add_parser("key", help="keys parked after a dead letter (on_dead_letter park_key)")
    key.add_argument("action", choices=["release"], help="what to do")
    key.add_argument("queue", help="the queue")
    key.add_argument("group", help="the consumer group")
    key.add_argument("key", help="the parked key")
    how = key.add_mutually_exclusive_group()
    how.add_argument(
        "--retry",
        dest="skip",
        action="store_false",
        help="the key's held messages flow again, oldest first (the default)",
    )
    how.add_argument(
        "--skip",
        action="store_true",
        help="dead-letter the key's messages stored until now, then let it flow",
    )
    _admin_api(key)
    key.set_defaults(func=key_command, skip=False)

    dlq = sub.add_parser("dlq", help="dead-letter queues: move letters back (redrive)")
    dlq.add_argument("action", choices=["redrive"], help="what to do")
    dlq.add_argument("dlq", help="the dead-letter queue, e.g. orders.dlq")
    dlq.add_argument("--to", help="target queue (default: each letter's original queue)")
    dlq.add_argument("--limit", type=_int_from(1), help="move at most this many (default: all)")
    dlq.add_argument("--where", metavar="key=VALUE", help="only the letters of this key")
    _admin_api(dlq)
    dlq.set_defaults(func=redrive_command)

    status = sub.add_parser("status", help="the gateway's role, version and listeners")
    _admin_api(status)
    status.add_argument("--json", action="store_true", help="print the admin API's JSON")
    status.set_defaults(func=status_command)

    inspect = sub.add_parser("inspect", help="partitions, owners, backlog and lag of a queue")
    inspect.add_argument("queue", help="the queue to inspect")
    _admin_api(inspect)
    inspect.add_argument("--json", action="store_true", help="print the admin API's JSON")
    inspect.set_defaults(func=inspect_command)

    publish = sub.add_parser("publish", help="publish one message through the admin API")
    publish.add_argument("queue", nargs="?", help="the queue (or give --topic instead)")
    publish.add_argument("payload", help="the message body (UTF-8 text)")
    publish.add_argument("--topic", help="publish to a topic: every subscribed queue gets it")
    publish.add_argument("--key", help="partition key (QUEUE_PARTITION_KEY)")
    publish.add_argument(
        "--property", action="append", metavar="NAME=VALUE", help="a property (repeat for more)"
    )
    publish.add_argument(
        "--delay", type=float, metavar="SECONDS", help="deliver no earlier than this after now"
    )
    publish.add_argument("--ttl", type=float, metavar="SECONDS", help="expire after this long")
    publish.add_argument(
        "--dedup-id",
        dest="dedup_id",
        help="dedup id (queues with a dedup window store one message per id)",
    )
    _admin_api(publish)
    publish.set_defaults(func=publish_command)

    consume = sub.add_parser("consume", help="consume and ack messages (native protocol)")
    consume.add_argument("queue", help="the queue to consume")
    consume.add_argument("--group", required=True, help="consumer group (created if new)")
    consume.add_argument(
        "--server", default="keygate://127.0.0.1:55555", help="native protocol URL"
    )
    _credentials(consume)
    consume.add_argument(
        "--window",
        type=_int_from(1, MAX_WINDOW),
        default=100,
        help="most delivered-unacked messages (default 100)",
    )
    consume.add_argument(
        "--count", type=_int_from(0), default=0, help="stop after N (0 = until idle)"
    )
    consume.add_argument("--timeout", type=float, default=5.0, help="stop when idle this long")
    _group_flags(consume)
    consume.set_defaults(func=_consume)

    passwd = sub.add_parser(
        "passwd", help="print the hash of a password (read from stdin) for the [users] table"
    )
    passwd.set_defaults(func=_passwd)

    health = sub.add_parser(
        "healthcheck", help="probe this host's /healthz (HTTP, else HTTPS), for containers"
    )
    health.add_argument("--config", help="TOML configuration file (as given to serve)")
    health.add_argument(
        "--timeout", type=float, default=2.0, help="seconds to wait for an answer (default 2)"
    )
    health.add_argument(
        "--active",
        action="store_true",
        help="healthy only while active (default: a standby is healthy too)",
    )
    health.set_defaults(func=_healthcheck)

    demo = sub.add_parser("demo", help="run a gateway with real traffic and verify it")
    demo.add_argument(
        "--messages", type=int, default=3000, help="messages to publish (default 3000)"
    )
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "queue" and args.action != "list" and not args.name:
        print("keygate: queue name required", file=sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except ConfigError as e:
        # A bad setting is a usage error, like a bad flag: exit 2, before anything starts.
        print(f"keygate: {e}", file=sys.stderr)
        return 2
    except (CliError, KeygateError) as e:
        print(f"keygate: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
