"""The ``keygate`` commands that work through the admin HTTP API (``--url``): queues,
groups, keys, dead-letter redrive, inspection, status and publishing."""

from __future__ import annotations

import argparse
import base64
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from core.settings import QUEUE_SETTINGS

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
    # A list, not max(a, *rest): with no rows, max(a) would iterate the int a.
    widths = [max([len(c), *(len(str(r.get(c, ""))) for r in rows)]) for c in columns]
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
        if group.get("keys"):
            print("\nkeys held back (kg_key_status)")
            _print_table(
                group["keys"],
                ["partition", "key", "reason", "detail", "attempts", "messages", "blocked_since"],
            )


def queue_command(args: argparse.Namespace) -> int:
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


def redrive_command(args: argparse.Namespace) -> int:
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


def name_values(flag: str, pairs: list[str] | None) -> dict[str, str]:
    """The NAME=VALUE arguments of a repeatable ``flag`` (--tag, --property) as a dict."""
    out = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        if not sep:
            raise CliError(f"{flag} takes NAME=VALUE, got {pair!r}")
        out[name] = value
    return out


def group_command(args: argparse.Namespace) -> int:
    path = f"/api/queues/{args.queue}/groups"
    if args.action == "create":
        if not args.name:
            raise CliError("group create needs QUEUE and NAME")
        body: dict[str, Any] = {"name": args.name, "tags": name_values("--tag", args.tag)}
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


def key_command(args: argparse.Namespace) -> int:
    path = (
        f"/api/queues/{urllib.parse.quote(args.queue, safe='')}/groups/"
        f"{urllib.parse.quote(args.group, safe='')}/keys/{urllib.parse.quote(args.key, safe='')}"
        "/release"
    )
    print(json.dumps(_http(args, "POST", path, {"skip": args.skip})))
    return 0


def status_command(args: argparse.Namespace) -> int:
    data = _http(args, "GET", "/api/status")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"gateway {data['name']}: {data['role']}")
    print(f"keygate {data['version']}, Python {data['python']}, database {data['database']}")
    if data["role"] == "standby":
        print("waiting for the active gateway's lease to lapse; protocol ports closed")
        return 0
    print(f"{data['queues']} queues, {data['groups_loaded']} consumer groups loaded")
    _print_table(
        [{"listener": name, "port": port} for name, port in sorted(data["listeners"].items())],
        ["listener", "port"],
    )
    return 0


def inspect_command(args: argparse.Namespace) -> int:
    data = _http(args, "GET", f"/api/queues/{args.queue}/inspect")
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print_inspection(data)
    return 0


def publish_command(args: argparse.Namespace) -> int:
    props = name_values("--property", args.property)
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
