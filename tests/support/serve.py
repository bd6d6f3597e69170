"""``keygate serve`` as a real subprocess, for tests that need a process to kill or signal."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

KEYGATE = [sys.executable, "-m", "gateway.cli"]
ALL_PORTS_FREE = [f"--{name}-port=0" for name in ("native", "mqtt", "amqp", "stomp", "http")]


def unused_port() -> int:
    """A free port for a gateway that must be told its port before it starts (a standby
    opens its ports only when it takes over). Taken below the kernel's ephemeral range:
    a port the kernel handed out itself could be given again to some client's outgoing
    connection before the gateway binds it (which happened under load)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
        ephemeral_low = int(ranges.read().split()[0])
    while True:
        port = random.randrange(10_000, ephemeral_low)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


@contextmanager
def serve(
    db_url: str, workdir: Path, *flags: str, name: str = "gateway"
) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, int], Path]]:
    """Start ``keygate serve`` on loopback, wait for its ports file, yield (process, ports,
    log file); on exit send SIGTERM (if it is still running) and wait for it."""
    ports_file, log = workdir / f"{name}.ports.json", workdir / f"{name}.log"
    ports_file.unlink(missing_ok=True)
    command = [*KEYGATE, "serve", "--db", db_url, "--host", "127.0.0.1", *ALL_PORTS_FREE]
    command += [*flags, "--ports-file", str(ports_file)]
    with (
        log.open("w") as output,
        subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT) as proc,
    ):
        deadline = time.monotonic() + 60
        while not ports_file.exists():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "keygate serve did not write its ports file"
            time.sleep(0.05)
        try:
            yield proc, json.loads(ports_file.read_text()), log
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
