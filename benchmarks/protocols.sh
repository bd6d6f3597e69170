#!/usr/bin/env bash
# Protocol benchmarks through a real gateway (its own process, a fresh SQLite file), each
# beside the peer broker already running on this machine: Mosquitto on 1883 for MQTT,
# RabbitMQ on 5672 (and its STOMP plugin on 61613, when enabled) for AMQP and STOMP.
#
#   benchmarks/protocols.sh [--db URL]
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
tmp=$(mktemp -d)
db="sqlite:///$tmp/bench.db"
if [ "${1:-}" = "--db" ]; then db=$2; fi
$py -m gateway.cli serve --db "$db" --host 127.0.0.1 --native-port 0 --mqtt-port 0 \
    --amqp-port 0 --stomp-port 0 --http-port 0 --ports-file "$tmp/ports.json" \
    > "$tmp/gateway.log" 2>&1 &
gateway=$!
trap 'kill $gateway 2>/dev/null; wait $gateway 2>/dev/null; rm -rf "$tmp"' EXIT
for _ in $(seq 600); do [ -f "$tmp/ports.json" ] && break; sleep 0.1; done
port() { $py -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$tmp/ports.json" "$1"; }
admin="--url=http://127.0.0.1:$(port http)"
$py -m gateway.cli queue create bench-mqtt --partitions 16 --subscribe bench/mqtt "$admin" >/dev/null
$py -m gateway.cli queue create stomp-bench --partitions 16 "$admin" >/dev/null

echo "== MQTT (QoS 1, paho) =="
$py -m benchmarks.mqtt --keygate "127.0.0.1:$(port mqtt)" --keygate-pid "$gateway" \
    --mosquitto 127.0.0.1:1883
# paho walks its in-flight messages on every PUBACK: at 1,000 in flight that walk, not the
# broker, sets the pace once the window fills (docs/performance.md, Ninth session).
echo "== MQTT (QoS 1, paho, 100 in flight) =="
$py -m benchmarks.mqtt --keygate "127.0.0.1:$(port mqtt)" --keygate-pid "$gateway" \
    --mosquitto 127.0.0.1:1883 --inflight 100
# Many devices at once, each with a small window (keygate's codec as a lean client).
echo "== MQTT (QoS 1, raw client, 100 connections x 10 in flight) =="
$py -m benchmarks.mqtt --keygate "127.0.0.1:$(port mqtt)" --keygate-pid "$gateway" \
    --mosquitto 127.0.0.1:1883 --client raw --connections 100 --inflight 10 --messages 100000
echo "== AMQP (aio-pika, publisher confirms) =="
$py -m benchmarks.amqp --keygate "127.0.0.1:$(port amqp)" --keygate-pid "$gateway"
echo "== STOMP (receipt every 100) =="
stomp_peer=()
if $py -c "import socket; socket.create_connection(('127.0.0.1', 61613), 1)" 2>/dev/null; then
    stomp_peer=(--rabbitmq 127.0.0.1:61613)
fi
$py -m benchmarks.stomp --keygate "127.0.0.1:$(port stomp)" --keygate-pid "$gateway" \
    "${stomp_peer[@]}"
