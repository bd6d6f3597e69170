"""The ``keygate`` command.

keygate serve [--config FILE] [--db URL] [--host H] [--native-port N] ...
keygate queue create|alter|list|show|browse|purge|delete ...  (admin HTTP API, --url)
keygate group create|list|delete|reset QUEUE ...      (admin HTTP API, --url)
keygate dlq redrive QUEUE.dlq [--to Q] [--limit K] [--where key=K]  (admin HTTP API)
keygate status [--json]                               (admin HTTP API, --url)
keygate inspect QUEUE [--json]                        (admin HTTP API, --url)
keygate publish QUEUE|--topic T PAYLOAD [--delay S] [--ttl S] [--dedup-id ID]
keygate consume QUEUE --group G                       (native protocol, --server)
keygate passwd < password                             (a password hash for [users])
keygate healthcheck [--config FILE]                   (probe this host's /healthz)
keygate demo                                          (a self-contained end-to-end run)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from core.errors import KeygateError
from core.model import GroupMode, KeyOrder, StartPosition
from core.settings import QUEUE_SETTINGS
from gateway import logs
from gateway.config import LISTENERS, load_config
from gateway.server import Gateway

DEFAULT_URL = "http://127.0.0.1:8080"


class CliError(Exception):
    pass


def _http(args: argparse.Namespace, method: str, path: str, body: Any = None) -> Any:
    url: str = args.url
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if args.user:
        token = base64.b64encode(f"{args.user}:{args.password or ''}".encode()).decode()
        headers["Authorization"] = f"Basic {token}"
    request = urllib.request.Request(
        url.rstrip("/") + path, data=data, method=method, headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        try:
            detail = json.loads(e.read())
            raise CliError(f"{detail['error']}: {detail['message']}") from e
        except (ValueError, KeyError):
            raise CliError(f"HTTP {e.code} from {url}") from e
    except urllib.error.URLError as e:
        raise CliError(f"cannot reach the gateway's admin API at {url}: {e.reason}") from e


def _print_table(rows: list[dict[str, Any]], columns: Sequence[str]) -> None:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in rows:
        print("  ".join(str(row.get(c, "")).ljust(w) for c, w in zip(columns, widths, strict=True)))


def print_inspection(data: dict[str, Any]) -> None:
    queue = data["queue"]
    print(
        f"queue {queue['name']}: {queue['partitions']} partitions, depth {queue['depth']}, "
        f"in-flight {queue['in_flight']}, dead letters {queue['dead_letters']}"
    )
    for group in data["groups"]:
        print(f"\ngroup {group['group']} ({group['mode']}, key_order {group['key_order']})")
        _print_table(
            group["partitions"],
            [
                "partition",
                "state",
                "owner_client",
                "owner_flow",
                "backlog",
                "in_flight",
                "committed_seq",
                "lag",
            ],
        )
        if group["flows"]:
            print()
            _print_table(
                group["flows"],
                ["client", "flow_id", "state", "window", "slots", "pending", "partitions"],
            )


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
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(gateway.serve_forever())
    except KeygateError as e:
        print(f"keygate: {e.message}", file=sys.stderr)
        return 1
    # Exiting non-zero after losing the lease lets a supervisor restart us as a standby.
    return 1 if gateway.lost_lease else 0


def _queue(args: argparse.Namespace) -> int:
    settings: dict[str, Any] = {
        s.name: value for s in QUEUE_SETTINGS if (value := getattr(args, s.name)) is not None
    }
    if args.action == "create":
        body = {"name": args.name, "subscriptions": args.subscribe or [], **settings}
        print(json.dumps(_http(args, "POST", "/api/queues", body), indent=2))
    elif args.action == "alter":
        if args.subscribe is not None:
            settings["subscriptions"] = args.subscribe  # replaces the queue's subscriptions
        if not settings:
            raise CliError("queue alter needs at least one setting to change")
        print(json.dumps(_http(args, "PATCH", f"/api/queues/{args.name}", settings), indent=2))
    elif args.action == "purge":
        print(json.dumps(_http(args, "POST", f"/api/queues/{args.name}/purge", {})))
    elif args.action == "list":
        _print_table(
            _http(args, "GET", "/api/queues"),
            ["name", "partitions", "depth", "bytes", "in_flight", "dead_letters"],
        )
    elif args.action == "show":
        print(json.dumps(_http(args, "GET", f"/api/queues/{args.name}"), indent=2))
    elif args.action == "browse":
        _browse(args)
    else:
        print(json.dumps(_http(args, "DELETE", f"/api/queues/{args.name}")))
    return 0


def _browse(args: argparse.Namespace) -> None:
    """Page through the stored messages, partition by partition, ``--limit`` at most."""
    if args.partition is not None:
        partitions: Sequence[int] = [args.partition]
    else:
        partitions = range(max(1, _http(args, "GET", f"/api/queues/{args.name}")["partitions"]))
    rows: list[dict[str, Any]] = []
    for partition in partitions:
        from_seq = args.from_seq
        while len(rows) < args.limit:
            page = _http(
                args,
                "GET",
                f"/api/queues/{args.name}/messages?partition={partition}"
                f"&from_seq={from_seq}&limit={min(1000, args.limit - len(rows))}",
            )
            if not page:
                break
            rows.extend(page)
            from_seq = page[-1]["seq"] + 1
            if args.limit > 1000:
                print(f"browsed {len(rows)} messages (partition {partition})", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    for row in rows:
        payload = row["payload"] if row["payload"] is not None else "<binary>"
        row["payload"] = payload if len(payload) <= 40 else payload[:37] + "..."
    _print_table(rows, ["partition", "seq", "key", "size", "message_id", "payload"])


def _redrive(args: argparse.Namespace) -> int:
    """Redrive in calls of at most 1,000 letters, printing progress between them."""
    key = None
    if args.where is not None:
        name, sep, key = args.where.partition("=")
        if name != "key" or not sep:
            raise CliError("--where takes key=VALUE")
    moved = skipped = 0
    while args.limit is None or moved < args.limit:
        chunk = 1000 if args.limit is None else min(1000, args.limit - moved)
        body = {"to": args.to, "key": key, "limit": chunk}
        result = _http(args, "POST", f"/api/queues/{args.dlq}/redrive", body)
        moved += result["moved"]
        skipped = result["skipped"]
        if result["moved"] < chunk:
            break
        print(f"moved {moved} ...", file=sys.stderr)
    print(json.dumps({"moved": moved, "left_in_place": skipped}))
    return 0


def _tags(pairs: list[str] | None) -> dict[str, str]:
    tags = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        if not sep:
            raise CliError(f"--tag takes NAME=VALUE, got {pair!r}")
        tags[name] = value
    return tags


def _group(args: argparse.Namespace) -> int:
    path = f"/api/queues/{args.queue}/groups"
    if args.action == "create":
        if not args.name:
            raise CliError("group create needs QUEUE and NAME")
        body: dict[str, Any] = {"name": args.name, "tags": _tags(args.tag)}
        for field_name in ("mode", "key_order", "start", "ack_timeout"):
            if (value := getattr(args, field_name)) is not None:
                body[field_name] = value
        print(json.dumps(_http(args, "POST", path, body), indent=2))
    elif args.action == "list":
        rows = _http(args, "GET", path)
        _print_table(rows, ["name", "mode", "key_order", "start", "tags", "ack_timeout"])
    elif args.action == "reset":
        if not (args.name and args.to):
            raise CliError("group reset needs QUEUE, NAME and --to")
        body = {"to": args.to, "force": args.force}
        print(json.dumps(_http(args, "POST", f"{path}/{args.name}/reset", body)))
    else:
        if not args.name:
            raise CliError("group delete needs QUEUE and NAME")
        print(json.dumps(_http(args, "DELETE", f"{path}/{args.name}")))
    return 0


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


def _status(args: argparse.Namespace) -> int:
    data = _http(args, "GET", "/api/status")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"gateway {data['name']}: {data['role']}")
    print(f"keygate {data['version']}, Python {data['python']}, database {data['database']}")
    print(f"{data['queues']} queues, {data['groups_loaded']} consumer groups loaded")
    _print_table(
        [{"listener": name, "port": port} for name, port in sorted(data["listeners"].items())],
        ["listener", "port"],
    )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    data = _http(args, "GET", f"/api/queues/{args.queue}/inspect")
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print_inspection(data)
    return 0


def _publish(args: argparse.Namespace) -> int:
    props = dict(p.split("=", 1) for p in args.property or [])
    body: dict[str, Any] = {"payload": args.payload, "key": args.key, "properties": props}
    for name in ("delay", "ttl", "dedup_id"):
        if (value := getattr(args, name)) is not None:
            body[name] = value
    if not (args.topic or args.queue):
        raise CliError("name a queue or --topic")
    if args.topic:
        path = f"/api/topics/{args.topic}/messages"
    else:
        path = f"/api/queues/{args.queue}/messages"
    print(json.dumps(_http(args, "POST", path, body)))
    return 0


def _consume(args: argparse.Namespace) -> int:
    from gateway.client import BlockingClient

    with BlockingClient(args.server, username=args.user, password=args.password) as client:
        consumer = client.subscribe(
            args.queue,
            group=args.group,
            window=args.window,
            tags=_tags(args.tag) or None,
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
    plain HTTP if on, else HTTPS — what a container healthcheck needs with TLS on."""
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
        except (urllib.error.URLError, OSError) as e:
            raise CliError(f"{scheme} port {port}: {e}") from e
    raise CliError("no HTTP or HTTPS listener on a fixed port to probe")


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
    serve.add_argument("--host", help="address to listen on (default 0.0.0.0)")
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
    browse.add_argument("--partition", type=int, help="browse only this partition")
    browse.add_argument(
        "--from-seq", dest="from_seq", type=int, default=0, help="first seq to show (default 0)"
    )
    browse.add_argument("--limit", type=int, default=100, help="most messages (default 100)")
    browse.add_argument("--json", action="store_true", help="print the messages as JSON")
    queue.set_defaults(func=_queue)

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
    group.set_defaults(func=_group)

    dlq = sub.add_parser("dlq", help="dead-letter queues: move letters back (redrive)")
    dlq.add_argument("action", choices=["redrive"], help="what to do")
    dlq.add_argument("dlq", help="the dead-letter queue, e.g. orders.dlq")
    dlq.add_argument("--to", help="target queue (default: each letter's original queue)")
    dlq.add_argument("--limit", type=int, help="move at most this many (default: all)")
    dlq.add_argument("--where", metavar="key=VALUE", help="only the letters of this key")
    _admin_api(dlq)
    dlq.set_defaults(func=_redrive)

    status = sub.add_parser("status", help="the gateway's role, version and listeners")
    _admin_api(status)
    status.add_argument("--json", action="store_true", help="print the admin API's JSON")
    status.set_defaults(func=_status)

    inspect = sub.add_parser("inspect", help="partitions, owners, backlog and lag of a queue")
    inspect.add_argument("queue", help="the queue to inspect")
    _admin_api(inspect)
    inspect.add_argument("--json", action="store_true", help="print the admin API's JSON")
    inspect.set_defaults(func=_inspect)

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
    publish.set_defaults(func=_publish)

    consume = sub.add_parser("consume", help="consume and ack messages (native protocol)")
    consume.add_argument("queue", help="the queue to consume")
    consume.add_argument("--group", required=True, help="consumer group (created if new)")
    consume.add_argument(
        "--server", default="keygate://127.0.0.1:55555", help="native protocol URL"
    )
    _credentials(consume)
    consume.add_argument(
        "--window", type=int, default=100, help="most delivered-unacked messages (default 100)"
    )
    consume.add_argument("--count", type=int, default=0, help="stop after N (0 = until idle)")
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
    health.add_argument("--timeout", type=float, default=2.0)
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
    except (CliError, KeygateError) as e:
        print(f"keygate: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
