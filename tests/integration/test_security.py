"""The attacks a security review tried, each tried again with real clients: anonymous
access from another host, a user without permissions, password guessing, plaintext
passwords, and taking over another user's MQTT client id."""

from __future__ import annotations

import asyncio
import base64
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from core.errors import AuthenticationFailed, InvalidArgument, PermissionDenied
from gateway.client import Client
from gateway.config import Permission
from gateway.inspect import inspect_queue
from gateway.server import Gateway
from protocols.mqtt import MQTT_3_1_1, ConnAck, Connect
from protocols.native.connection import ClientConnection
from protocols.native.events import Bind, BindOk, Hello, HelloOk
from tests.integration.conftest import native_url, start_gateway
from tests.support.mqtt_raw import RawMqtt
from tests.support.native_raw import expect
from tests.support.security import ADMIN, hashed_users, non_loopback_address
from tests.support.wait import eventually

WAIT = 10.0


def _remote() -> str:
    address = non_loopback_address()
    if address is None:
        pytest.skip("this host has no non-loopback address to connect from")
    return address


def _basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


class Paho:
    """A paho-mqtt (MQTT 5) client: its CONNACK and each QoS 1 PUBACK reason code."""

    def __init__(self, host: str, port: int, client_id: str, user: str | None = None) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id, protocol=5, reconnect_on_failure=False
        )
        if user is not None:
            self.client.username_pw_set(user, f"{user}-pw")
        self.host, self.port = host, port
        self.connack: list[int] = []
        self.acks: dict[int, int] = {}
        self.changed = threading.Condition()
        self.client.on_connect = self._on_connect
        self.client.on_publish = self._on_publish

    def _on_connect(self, _c: Any, _u: Any, _f: Any, code: Any, _p: Any) -> None:
        with self.changed:
            self.connack.append(int(code.value))
            self.changed.notify_all()

    def _on_publish(self, _c: Any, _u: Any, mid: int, code: Any, _p: Any) -> None:
        with self.changed:
            self.acks[mid] = int(code.value)
            self.changed.notify_all()

    def _wait(self, ready: Callable[[], bool]) -> None:
        with self.changed:
            assert self.changed.wait_for(ready, WAIT), "no answer from the gateway"

    def connect(self) -> int:
        """Blocks until the CONNACK; its reason code."""
        self.client.connect(self.host, self.port)
        self.client.loop_start()
        self._wait(lambda: bool(self.connack))
        return self.connack[0]

    def publish(self, topic: str, payload: bytes) -> int:
        """Blocks until the PUBACK; its reason code."""
        mid = self.client.publish(topic, payload, qos=1).mid
        self._wait(lambda: mid in self.acks)
        return self.acks[mid]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _pika(host: str, port: int, user: str | None, action: Callable[[Any], object]) -> int | None:
    """Run ``action(channel)`` with pika; the reply code if the gateway refused it."""
    import pika
    import pika.exceptions

    params: dict[str, Any] = {}
    if user is not None:
        params["credentials"] = pika.PlainCredentials(user, f"{user}-pw")
    try:
        connection = pika.BlockingConnection(pika.ConnectionParameters(host, port, **params))
    except pika.exceptions.ProbableAccessDeniedError:
        return 403
    except pika.exceptions.AMQPConnectionError as e:
        closed = e.args[0] if e.args else None
        return int(getattr(closed, "reply_code", 403))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        action(channel)
        return None
    except pika.exceptions.ChannelClosedByBroker as e:
        return int(e.reply_code)
    finally:
        if connection.is_open:
            connection.close()


def _stomp(host: str, port: int, user: str | None) -> str | None:
    """CONNECT and SEND with a receipt using stomp.py; the ERROR message if refused."""
    import stomp
    import stomp.exception

    errors: list[str] = []
    answered = threading.Event()

    class Listener(stomp.ConnectionListener):  # type: ignore[misc]
        def on_error(self, frame: Any) -> None:
            errors.append(frame.headers.get("message", ""))
            answered.set()

        def on_receipt(self, frame: Any) -> None:
            answered.set()

    conn = stomp.Connection12([(host, port)], heartbeats=(0, 0))
    conn.set_listener("l", Listener())
    try:
        if user is None:
            conn.connect(wait=True)
        else:
            conn.connect(user, f"{user}-pw", wait=True)
        conn.send("/queue/orders", b"x", headers={"receipt": "r1"})
    except stomp.exception.StompException:
        answered.wait(WAIT)
        return errors[0] if errors else "refused"
    assert answered.wait(WAIT), "no STOMP answer"
    if errors:
        return errors[0]  # the server closed the connection after its ERROR
    conn.disconnect()
    return None


async def _users_gateway(db_url: str, **settings: Any) -> Gateway:
    """alice may do anything; eve has no permissions entry; watcher may monitor orders;
    sender may publish to it."""
    gateway = await start_gateway(
        db_url,
        users=hashed_users(
            alice="alice-pw", eve="eve-pw", watcher="watcher-pw", sender="sender-pw"
        ),
        permissions={
            "alice": ADMIN,
            "watcher": Permission(monitor=("orders",)),
            "sender": Permission(publish=("orders",)),
        },
        **settings,
    )
    url = native_url(gateway)
    async with Client(url, username="alice", password="alice-pw") as alice:
        await alice.declare_queue("orders", partitions=1, subscriptions=["orders/#"])
        assert await alice.publish("orders", b"for alice")
    return gateway


async def test_anonymous_clients_from_another_address_are_refused_by_default(
    sqlite_url: str,
) -> None:
    remote = _remote()
    gateway = await start_gateway(sqlite_url, host="0.0.0.0")
    ports = gateway.ports
    try:
        async with Client(native_url(gateway)) as local:  # loopback: the developer's own box
            await local.declare_queue("orders", partitions=1, subscriptions=["orders/#"])
        with pytest.raises(PermissionDenied, match="loopback"):
            await Client(
                f"keygate://{remote}:{ports['native']}", max_reconnect_attempts=0
            ).connect()
        mqtt = Paho(remote, ports["mqtt"], "outsider")
        assert await asyncio.to_thread(mqtt.connect) == 0x87  # not authorized
        mqtt.close()
        assert await asyncio.to_thread(_pika, remote, ports["amqp"], None, lambda _: None) == 403
        assert await asyncio.to_thread(_stomp, remote, ports["stomp"], None) is not None
        async with aiohttp.ClientSession() as http:
            base = f"http://{remote}:{ports['http']}"
            assert (await http.get(f"{base}/healthz")).status == 200
            purge = await http.post(f"{base}/api/queues/orders/purge")
            assert purge.status == 403
            assert (await http.delete(f"{base}/api/queues/orders")).status == 403
            local = await http.get(f"http://127.0.0.1:{ports['http']}/api/queues/orders")
            assert local.status == 200  # the remote purge and delete did nothing
    finally:
        await gateway.stop()


async def test_allow_anonymous_admits_anonymous_clients_from_any_address(sqlite_url: str) -> None:
    remote = _remote()
    gateway = await start_gateway(sqlite_url, host="0.0.0.0", allow_anonymous=True)
    try:
        url = f"keygate://{remote}:{gateway.ports['native']}"
        async with Client(url) as client:
            await client.declare_queue("orders", partitions=1)
            assert await client.publish("orders", b"from afar")
    finally:
        await gateway.stop()


async def test_a_user_without_permissions_is_refused_on_every_protocol_and_the_http_api(
    sqlite_url: str,
) -> None:
    gateway = await _users_gateway(sqlite_url)
    ports = gateway.ports
    try:
        async with Client(native_url(gateway), username="eve", password="eve-pw") as eve:
            # A queue that exists and one that does not answer alike: no existence oracle.
            for queue in ("orders", "no-such-queue"):
                with pytest.raises(PermissionDenied):
                    await eve.publish(queue, b"x")
                with pytest.raises(PermissionDenied):
                    await eve.subscribe(queue, group="stolen")
            # A topic refused names the topic, not the queues subscribed to it.
            with pytest.raises(PermissionDenied) as refused:
                await eve.publish_topic("orders/eu", b"x")
            assert "orders/eu" in refused.value.message
            assert "queue" not in refused.value.message
            with pytest.raises(PermissionDenied):
                await eve.declare_queue("orders", partitions=1)
        mqtt = Paho("127.0.0.1", ports["mqtt"], "eve-device", "eve")
        assert await asyncio.to_thread(mqtt.connect) == 0
        assert await asyncio.to_thread(mqtt.publish, "orders/eu", b"x") == 0x87
        mqtt.close()

        def publish(channel: Any) -> None:
            channel.basic_publish("", "orders", b"x")

        def passive(channel: Any) -> None:
            channel.queue_declare("orders", passive=True)

        def exchange(channel: Any) -> None:
            channel.exchange_declare("eves-exchange", "topic")

        amqp = ports["amqp"]
        for action in (publish, passive, exchange):
            assert await asyncio.to_thread(_pika, "127.0.0.1", amqp, "eve", action) == 403
        refused = await asyncio.to_thread(_stomp, "127.0.0.1", ports["stomp"], "eve")
        assert refused == "not authorized"
        async with aiohttp.ClientSession(headers=_basic("eve", "eve-pw")) as http:
            base = f"http://127.0.0.1:{ports['http']}"
            assert await (await http.get(f"{base}/api/queues")).json() == []
            for path in ("/api/queues/orders", "/api/queues/orders/inspect", "/metrics"):
                assert (await http.get(base + path)).status == 403, path
            assert (await http.post(f"{base}/api/queues/orders/purge")).status == 403
            for queue in ("orders", "no-such-queue"):
                url = f"{base}/api/queues/{queue}/messages"
                assert (await http.post(url, json={"payload": "x"})).status == 403, queue
                assert (await http.get(url)).status == 403, queue
        async with Client(native_url(gateway), username="alice", password="alice-pw") as alice:
            consumer = await alice.subscribe("orders", group="g")
            assert (await consumer.receive(timeout=WAIT)).payload == b"for alice"
            with pytest.raises(TimeoutError):  # nothing of eve's got in
                await consumer.receive(timeout=0.5)
    finally:
        await gateway.stop()


async def test_the_monitor_permission_allows_inspection_but_not_consuming_or_publishing(
    sqlite_url: str,
) -> None:
    gateway = await _users_gateway(sqlite_url)
    ports = gateway.ports
    try:
        async with aiohttp.ClientSession(headers=_basic("watcher", "watcher-pw")) as http:
            base = f"http://127.0.0.1:{ports['http']}"
            inspected = await http.get(f"{base}/api/queues/orders/inspect")
            assert inspected.status == 200
            listed = await (await http.get(f"{base}/api/queues")).json()
            assert [q["name"] for q in listed] == ["orders"]  # not orders.dlq
            status = await (await http.get(f"{base}/api/status")).json()
            assert status["queues"] == 1  # orders.dlq exists too, but is not theirs
        async with aiohttp.ClientSession(headers=_basic("eve", "eve-pw")) as http:
            status = await (await http.get(f"{base}/api/status")).json()
            assert (status["role"], status["queues"], status["groups_loaded"]) == ("active", 0, 0)
        passive = await asyncio.to_thread(
            _pika,
            "127.0.0.1",
            ports["amqp"],
            "watcher",
            lambda channel: channel.queue_declare("orders", passive=True),
        )
        assert passive is None
        async with Client(native_url(gateway), username="watcher", password="watcher-pw") as w:
            with pytest.raises(PermissionDenied):
                await w.subscribe("orders", group="g")
            with pytest.raises(PermissionDenied):
                await w.publish("orders", b"x")
    finally:
        await gateway.stop()


async def test_a_publisher_may_passively_declare_its_queue_without_learning_its_depth(
    sqlite_url: str,
) -> None:
    """docs/protocols/amqp.md said a passive queue.declare needs monitor; publish suffices
    (publishers check their queue at start-up), and the count is 0 without monitor."""
    gateway = await _users_gateway(sqlite_url)
    counts: list[int] = []

    def passive(channel: Any) -> None:
        counts.append(channel.queue_declare("orders", passive=True).method.message_count)

    try:
        for user in ("sender", "watcher"):
            refused = await asyncio.to_thread(
                _pika, "127.0.0.1", gateway.ports["amqp"], user, passive
            )
            assert refused is None, user
        assert counts == [0, 1]  # watcher may monitor: the stored message of alice's
    finally:
        await gateway.stop()


async def test_metrics_need_a_permission_that_covers_every_queue(sqlite_url: str) -> None:
    """/metrics names every queue: monitor = ["?"] matched the name "*" it was checked
    against, and was let in (QA)."""
    gateway = await start_gateway(
        sqlite_url,
        users=hashed_users(star="star-pw", all="all-pw"),
        permissions={"star": Permission(monitor=("?",)), "all": Permission(monitor=("*",))},
    )
    url = f"http://127.0.0.1:{gateway.ports['http']}/metrics"
    try:
        async with aiohttp.ClientSession() as http:
            refused = await http.get(url, headers=_basic("star", "star-pw"))
            assert refused.status == 403
            assert (await refused.json())["error"] == "permission-denied"
            assert (await http.get(url, headers=_basic("all", "all-pw"))).status == 200
    finally:
        await gateway.stop()


async def test_repeated_failed_logins_from_one_address_are_throttled(sqlite_url: str) -> None:
    gateway = await start_gateway(sqlite_url, host="0.0.0.0", users=hashed_users(alice="alice-pw"))
    url = f"keygate://127.0.0.1:{gateway.ports['native']}"

    async def login(address_url: str, password: str) -> None:
        client = Client(address_url, username="alice", password=password, max_reconnect_attempts=0)
        await client.connect()
        await client.close()

    try:
        for _ in range(5):
            with pytest.raises(AuthenticationFailed, match="bad username or password"):
                await login(url, "guess")
        with pytest.raises(AuthenticationFailed, match="too many failed logins"):
            await login(url, "alice-pw")  # even the right password, while blocked
        remote = non_loopback_address()
        if remote is not None:  # another address is not blocked
            await login(f"keygate://{remote}:{gateway.ports['native']}", "alice-pw")

        async def unblocked() -> bool:
            try:
                await login(url, "alice-pw")
            except AuthenticationFailed:
                return False
            return True

        await eventually(unblocked, timeout=5)
    finally:
        await gateway.stop()


async def test_plaintext_passwords_stop_the_gateway_from_starting_unless_allowed(
    sqlite_url: str,
) -> None:
    with pytest.raises(InvalidArgument, match="plaintext"):
        await start_gateway(sqlite_url, users={"alice": "alice-pw"})
    gateway = await start_gateway(
        sqlite_url, users={"alice": "alice-pw"}, allow_plaintext_passwords=True
    )
    try:
        await Client(native_url(gateway), username="alice", password="alice-pw").connect()
    finally:
        await gateway.stop()


async def test_keygate_passwd_prints_a_hash_the_gateway_accepts(sqlite_url: str) -> None:
    made = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "gateway.cli", "passwd"],
        input="correct horse\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    stored = made.stdout.strip()
    assert stored.startswith("scrypt$") and "correct horse" not in stored
    gateway = await start_gateway(sqlite_url, users={"carol": stored})
    try:
        url = native_url(gateway)
        async with Client(url, username="carol", password="correct horse"):
            pass
        with pytest.raises(AuthenticationFailed):
            await Client(url, username="carol", password="correct horse!").connect()
    finally:
        await gateway.stop()


async def test_an_mqtt_client_id_is_taken_over_only_by_its_own_user(sqlite_url: str) -> None:
    gateway = await start_gateway(
        sqlite_url,
        users=hashed_users(alice="alice-pw", bob="bob-pw"),
        permissions={"alice": ADMIN, "bob": ADMIN},
    )
    port = gateway.ports["mqtt"]
    alice = Paho("127.0.0.1", port, "meter-1", "alice")
    try:
        async with Client(native_url(gateway), username="alice", password="alice-pw") as admin:
            await admin.declare_queue("orders", partitions=1, subscriptions=["orders/#"])
        assert await asyncio.to_thread(alice.connect) == 0
        bob = Paho("127.0.0.1", port, "meter-1", "bob")
        assert await asyncio.to_thread(bob.connect) == 0x85  # client identifier not valid
        bob.close()
        raw = await RawMqtt.open(port, MQTT_3_1_1)
        await raw.send(Connect("meter-1", MQTT_3_1_1, username="bob", password=b"bob-pw"))
        connack = await raw.receive()
        assert isinstance(connack, ConnAck) and connack.reason_code == 2  # identifier rejected
        assert await asyncio.to_thread(alice.publish, "orders/eu", b"still alice's") == 0
        again = Paho("127.0.0.1", port, "meter-1", "alice")
        assert await asyncio.to_thread(again.connect) == 0  # her own takeover is allowed
        again.close()
    finally:
        alice.close()
        await RawMqtt.close_all()
        await gateway.stop()


async def _all_reserved(gateway: Gateway) -> bool:
    assert gateway.broker is not None
    (group,) = (await inspect_queue(gateway.broker, gateway.store, "orders"))["groups"]
    return all(p["state"] == "unbound" for p in group["partitions"])


def _bind_as(port: int, user: str, previous: frozenset[int] | None) -> frozenset[int]:
    """HELLO as ``user`` under the client name "pos-7", BIND group g of orders claiming
    ``previous``; the partitions granted. The socket is closed after the answer."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        conn = ClientConnection()
        sock.sendall(conn.send(Hello(client_name="pos-7", username=user, password=f"{user}-pw")))
        expect(sock, conn, HelloOk)
        bind = Bind(
            request_id=conn.next_request_id(),
            queue="orders",
            group="g",
            window=10,
            previous_partitions=previous,
        )
        sock.sendall(conn.send(bind))
        ok = expect(sock, conn, BindOk)
        assert isinstance(ok, BindOk)
        return ok.partitions


async def test_another_user_cannot_take_a_clients_reserved_partitions_by_its_name(
    sqlite_url: str,
) -> None:
    """The rebalance delay keeps a disconnected consumer's partitions for *its* reconnect:
    mallory, who may consume too, names alice's client and claims them, and gets none;
    alice's own reconnect gets them back."""
    gateway = await start_gateway(
        sqlite_url,
        users=hashed_users(alice="alice-pw", mallory="mallory-pw"),
        permissions={"alice": ADMIN, "mallory": ADMIN},
    )
    port = gateway.ports["native"]
    try:
        async with Client(native_url(gateway), username="alice", password="alice-pw") as admin:
            await admin.declare_queue("orders", partitions=4, rebalance_delay=30.0)
        held = await asyncio.to_thread(_bind_as, port, "alice", None)
        assert held == frozenset(range(4))
        await eventually(lambda: _all_reserved(gateway))  # alice's connection is gone
        assert await asyncio.to_thread(_bind_as, port, "mallory", held) == frozenset()
        assert await asyncio.to_thread(_bind_as, port, "alice", held) == held
    finally:
        await gateway.stop()


async def test_the_admin_api_refuses_what_another_site_could_send_with_cached_credentials(
    sqlite_url: str,
) -> None:
    """A browser attaches the Basic credentials it cached for the console to a form POST
    from any page: a purge with a foreign Origin, or a JSON body sent as text/plain, was
    carried out. Same-origin and program requests (no Origin, JSON) still work."""
    gateway = await _users_gateway(sqlite_url)
    base = f"http://127.0.0.1:{gateway.ports['http']}"
    try:
        async with aiohttp.ClientSession(headers=_basic("alice", "alice-pw")) as http:
            forged = await http.post(
                f"{base}/api/queues/orders/purge",
                data={"x": "1"},
                headers={"Origin": "http://evil.example"},
            )
            assert forged.status == 403
            as_text = await http.post(
                f"{base}/api/queues/orders/groups",
                data='{"name": "planted"}',
                headers={"Content-Type": "text/plain"},
            )
            assert as_text.status == 400
            groups = await (await http.get(f"{base}/api/queues/orders/groups")).json()
            assert [g["name"] for g in groups] == []
            assert (await (await http.get(f"{base}/api/queues/orders")).json())["depth"] == 1
            same = await http.post(
                f"{base}/api/queues/orders/groups", json={"name": "ops"}, headers={"Origin": base}
            )
            assert same.status == 201
            assert (await http.post(f"{base}/api/queues/orders/purge")).status == 200
    finally:
        await gateway.stop()
