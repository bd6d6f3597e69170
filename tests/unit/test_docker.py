"""docker/ cannot be built here (no engine), so check what can be checked without one."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile*"))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_path_a_dockerfile_copies_exists(dockerfile: Path) -> None:
    for line in dockerfile.read_text().splitlines():
        match = re.match(r"COPY\s+(?!--from)(.+)\s+\S+$", line.strip())
        if match:
            for source in match.group(1).split():
                assert (ROOT / source).exists(), f"{dockerfile.name} copies missing {source}"


def test_compose_file_is_valid() -> None:
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.skip("docker-compose is not installed; the compose file is checked where it is")
    result = subprocess.run(
        [compose, "-f", str(ROOT / "docker" / "compose.yaml"), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_compose_runs_the_gateway_on_postgresql_with_every_port_published() -> None:
    text = (ROOT / "docker" / "compose.yaml").read_text()
    assert "KEYGATE_DB: postgresql://" in text
    for port in (1883, 5672, 61613, 55555, 8080):
        assert f'"{port}:{port}"' in text


def test_the_compose_spark_job_passes_only_flags_its_example_accepts() -> None:
    compose = (ROOT / "docker" / "compose.yaml").read_text()
    command = re.search(r'command: \["spark\.examples\.(\w+)"(.*)\]', compose)
    assert command is not None
    examples = ROOT / "spark" / "examples"
    # An example's own options plus the ones every example shares (demo.arguments).
    example = (examples / f"{command.group(1)}.py").read_text() + (examples / "demo.py").read_text()
    for flag in re.findall(r'"(--[\w-]+)"', command.group(2)):
        assert f'"{flag}"' in example, f"{command.group(1)} has no {flag} option"
