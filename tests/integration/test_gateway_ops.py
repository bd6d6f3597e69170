"""Operations: active/standby failover, authentication, metrics and the admin API."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import sqlalchemy as sa

from core.errors import AuthenticationFailed, PermissionDenied
from core.model import QueueConfig
from gateway.client import Client
from gateway.config import Permission
from gateway.server import Gateway
from storage.engine import async_engine
from storage.schema import kg_gateway_lease
from tests.integration.conftest import native_url, start_gateway
from tests.support.security import ADMIN, hashed_users
from tests.support.wait import eventually


async def test_standby_gateway_takes_over_when_the_active_one_stops(db_url: str) -> None:
    first = await start_gateway(db_url, lease_ttl=1.0)
    async with Client(native_url(first)) as client:
        await client.declare_queue("orders", partitions=2)
        for i in range(10):
            await client.publish("orders", b"%d" % i, key=f"k{i}")
    standby = asyncio.create_task(start_gateway(db_url, lease_ttl=1.0))
    try:
        # While the active gateway renews its lease the standby opens no listener.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(standby), 1.5)
        await first.stop()
        second = await asyncio.wait_for(standby, 10)
    finally:
        await first.stop()
    try:
        async with Client(native_url(second)) as client:
            consumer = await client.subscribe("orders", group="g")
            got = {(await consumer.receive(timeout=5)).payload for _ in range(10)}
            assert got == {b"%d" % i for i in range(10)}
    finally:
        await second.stop()


async def test_a_gateway_that_stops_renewing_is_replaced_after_the_lease_ttl(db_url: str) -> None:
    first = await start_gateway(db_url, lease_ttl=1.0)
    try:
        assert first._lease_task is not None
        first._lease_task.cancel()  # a hung process: it no longer renews
        second = await asyncio.wait_for(start_gateway(db_url, lease_ttl=1.0), 10)
        await second.stop()
    finally:
        await first.stop()


async def test_a_gateway_that_finds_its_lease_taken_stops_itself(db_url: str) -> None:
    gateway = await start_gateway(db_url, lease_ttl=0.6)
    engine = async_engine(db_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                sa.update(kg_gateway_lease).values(holder="someone-else", expires_at=1e12)
            )
        await eventually(lambda: gateway.lost_lease, timeout=5)
        await asyncio.wait_for(gateway.wait_closed(), 30)
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", gateway.ports["native"])
    finally:
        await engine.dispose()
        await gateway.stop()


async def test_wrong_credentials_and_missing_permissions_are_refused(sqlite_url: str) -> None:
    gateway = await start_gateway(
        sqlite_url,
        users=hashed_users(alice="secret", bob="pw"),
        permissions={"alice": ADMIN, "bob": Permission(publish=("public-*",))},
    )
    try:
        with pytest.raises(AuthenticationFailed):
            await Client(native_url(gateway), username="alice", password="wrong").connect()
        async with Client(native_url(gateway), username="alice", password="secret") as alice:
            await alice.declare_queue("orders", partitions=1)
            await alice.declare_queue("public-news", partitions=1)
        async with Client(native_url(gateway), username="bob", password="pw") as bob:
            assert await bob.publish("public-news", b"ok")
            with pytest.raises(PermissionDenied):
                await bob.publish("orders", b"no")
            with pytest.raises(PermissionDenied):
                await bob.subscribe("public-news", group="g")
    finally:
        await gateway.stop()


async def test_metrics_count_publishes_and_the_admin_api_inspects_queues(
    gateway: Gateway,
) -> None:
    base = f"http://127.0.0.1:{gateway.ports['http']}"
    async with aiohttp.ClientSession() as http:
        created = await http.post(f"{base}/api/queues", json={"name": "orders", "partitions": 4})
        assert created.status == 201
        bad = await http.post(f"{base}/api/queues", json={"name": "bad name!"})
        assert bad.status == 400 and (await bad.json())["error"] == "invalid-argument"
        missing = await http.get(f"{base}/api/queues/nope")
        assert missing.status == 404
        sent = await http.post(
            f"{base}/api/queues/orders/messages", json={"payload": "hi", "key": "k1"}
        )
        assert sent.status == 201
        metrics = await (await http.get(f"{base}/metrics")).text()
        assert 'keygate_published_total{protocol="http",queue="orders"} 1.0' in metrics
        shown = await (await http.get(f"{base}/api/queues/orders")).json()
        assert shown["depth"] == 1 and shown["partitions"] == 4
        # Every setting is shown (backoff, on_dead_letter, limits... were SQL-only).
        tuned = {
            "name": "tuned",
            "backoff_initial": 0.7,
            "on_dead_letter": "park_key",
            "max_depth_bytes": 4096,
            "retention": 30.0,
            "dedup_window": 60.0,
        }
        assert (await http.post(f"{base}/api/queues", json=tuned)).status == 201
        again = {"name": "tuned", "exist_ok": True}
        assert (await http.post(f"{base}/api/queues", json=again)).status == 201
        differs = await http.post(f"{base}/api/queues", json={**again, "backoff_initial": 0.9})
        assert differs.status == 409
        assert "backoff_initial=0.7, not 0.9" in (await differs.json())["message"]
        shown = await (await http.get(f"{base}/api/queues/tuned")).json()
        assert {f.name for f in dataclasses.fields(QueueConfig)} <= shown.keys()
        assert {k: shown[k] for k in tuned} == tuned
        listed = await (await http.get(f"{base}/api/queues")).json()
        assert next(q for q in listed if q["name"] == "tuned")["on_dead_letter"] == "park_key"
        # The list reads every queue's stats in one statement: the same numbers as show.
        orders = await (await http.get(f"{base}/api/queues/orders")).json()
        assert next(q for q in listed if q["name"] == "orders") == orders


async def test_inspect_lists_for_a_shared_flow_every_partition_its_bind_ok_did(
    gateway: Gateway,
) -> None:
    base = f"http://127.0.0.1:{gateway.ports['http']}"
    async with Client(native_url(gateway)) as client, aiohttp.ClientSession() as http:
        await client.declare_queue("jobs", partitions=3)
        await client.declare_queue("tasks")  # non-partitioned: its groups are shared
        consumers = {
            "jobs": await client.subscribe("jobs", group="workers", mode="shared"),
            "tasks": await client.subscribe("tasks", group="workers"),
        }
        for queue, consumer in consumers.items():
            inspected = await (await http.get(f"{base}/api/queues/{queue}/inspect")).json()
            ((flow,),) = [g["flows"] for g in inspected["groups"]]
            assert flow["partitions"] == sorted(consumer.partitions), queue
        assert consumers["jobs"].partitions == {0, 1, 2}


async def test_the_ports_file_is_replaced_at_start_and_removed_at_stop(
    sqlite_url: str, tmp_path: Path
) -> None:
    ports_file = tmp_path / "ports.json"
    ports_file.write_text('{"native": 1}')  # left by an earlier run
    gateway = await start_gateway(sqlite_url, ports_file=str(ports_file))
    try:
        assert json.loads(ports_file.read_text()) == gateway.ports
    finally:
        await gateway.stop()
    assert not ports_file.exists()


async def test_listener_counters_are_exported(gateway: Gateway) -> None:
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    async with Client(native_url(gateway)) as client:
        await client.declare_queue("telemetry", subscriptions=["devices/#"])

    def publish_one() -> None:
        device = mqtt.Client(CallbackAPIVersion.VERSION2, "dev-1", protocol=mqtt.MQTTv5)
        device.connect("127.0.0.1", gateway.ports["mqtt"])
        device.loop_start()
        device.publish("devices/1", b"21.5", qos=1).wait_for_publish(10)
        device.loop_stop()
        device.disconnect()

    await asyncio.to_thread(publish_one)
    base = f"http://127.0.0.1:{gateway.ports['http']}"
    async with aiohttp.ClientSession() as http:
        metrics = await (await http.get(f"{base}/metrics")).text()
    assert 'keygate_listener_publishes_total{listener="mqtt"} 1.0' in metrics
    assert 'keygate_listener_connections_total{listener="mqtt"} 1.0' in metrics


def _basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


async def test_administration_needs_credentials_and_the_admin_permission(
    sqlite_url: str,
) -> None:
    gateway = await start_gateway(
        sqlite_url,
        users=hashed_users(alice="secret", bob="pw"),
        permissions={"alice": ADMIN, "bob": Permission(publish=("public-*",))},
    )
    base = f"http://127.0.0.1:{gateway.ports['http']}"
    alice, bob = _basic("alice", "secret"), _basic("bob", "pw")
    try:
        async with aiohttp.ClientSession() as http:
            assert (await http.get(f"{base}/healthz")).status == 200  # probes stay open
            anonymous = await http.get(f"{base}/api/queues")
            assert anonymous.status == 401 and "Basic" in anonymous.headers["WWW-Authenticate"]
            wrong = await http.get(f"{base}/api/queues", headers=_basic("alice", "x"))
            assert wrong.status == 401
            refused = await http.post(f"{base}/api/queues", json={"name": "x"}, headers=bob)
            assert refused.status == 403 and (await refused.json())["error"] == "permission-denied"
            created = await http.post(
                f"{base}/api/queues", json={"name": "public-news"}, headers=alice
            )
            assert created.status == 201
            sent = await http.post(
                f"{base}/api/queues/public-news/messages", json={"payload": "hi"}, headers=bob
            )
            assert sent.status == 201
            gone = await http.delete(f"{base}/api/queues/public-news", headers=bob)
            assert gone.status == 403
        async with Client(native_url(gateway), username="bob", password="pw") as client:
            with pytest.raises(PermissionDenied):
                await client.declare_queue("bobs-own", partitions=1)
            await client.declare_queue("public-news")  # checking an existing one is fine
            with pytest.raises(PermissionDenied):
                await client.delete_queue("public-news")
        listed = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "queue",
                "list",
                f"--url={base}",
                "--user",
                "alice",
                "--password",
                "secret",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert listed.returncode == 0 and "public-news" in listed.stdout, listed.stderr
    finally:
        await gateway.stop()


async def test_an_amqp_publisher_without_admin_cannot_create_queues(sqlite_url: str) -> None:
    import pika
    import pika.exceptions

    gateway = await start_gateway(
        sqlite_url,
        users=hashed_users(alice="secret", bob="pw"),
        permissions={"alice": ADMIN, "bob": Permission(publish=("orders",))},
    )

    def declare(queue: str) -> int | None:
        credentials = pika.PlainCredentials("bob", "pw")
        params = pika.ConnectionParameters(
            "127.0.0.1", gateway.ports["amqp"], credentials=credentials
        )
        connection = pika.BlockingConnection(params)
        try:
            connection.channel().queue_declare(queue, durable=True)
            return None
        except pika.exceptions.ChannelClosedByBroker as e:
            return int(e.reply_code)
        finally:
            if connection.is_open:
                connection.close()

    try:
        async with Client(native_url(gateway), username="alice", password="secret") as admin:
            await admin.declare_queue("orders")
        assert await asyncio.to_thread(declare, "orders") is None  # existing: fine
        assert await asyncio.to_thread(declare, "new-queue") == 403  # ACCESS_REFUSED
    finally:
        await gateway.stop()
