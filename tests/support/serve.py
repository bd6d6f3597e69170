"""``keygate serve`` as a real subprocess, for tests that need a process to kill or signal."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

KEYGATE = [sys.executable, "-m", "gateway.cli"]
ALL_PORTS_FREE = [f"--{name}-port=0" for name in ("native", "mqtt", "amqp", "stomp", "http")]


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
