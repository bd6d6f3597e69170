"""The admin API's OpenAPI document is true: every route the server has is in it (and
nothing else), and schemathesis, run against a live gateway with a small budget, finds no
server error and no response that the document does not describe."""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

import aiohttp
import pytest

from gateway.http import AdminServer
from gateway.server import Gateway

_METHODS = {"GET", "POST", "PATCH", "PUT", "DELETE"}


async def _document(sqlite_gateway: Gateway) -> dict[str, object]:
    url = f"http://127.0.0.1:{sqlite_gateway.ports['http']}/api/openapi.json"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200
        document: dict[str, object] = await response.json()
        return document


async def test_every_route_the_server_has_is_in_the_openapi_document(
    sqlite_gateway: Gateway,
) -> None:
    document = await _document(sqlite_gateway)
    assert document["openapi"] == "3.1.0"
    paths = document["paths"]
    assert isinstance(paths, dict)
    documented = {(path, method.upper()) for path, ops in paths.items() for method in ops}
    documented -= {(path, "PARAMETERS") for path in paths}
    assert sqlite_gateway.broker is not None
    served = set()
    for route in AdminServer(sqlite_gateway.broker, sqlite_gateway.store).app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        if "prefix" in info or route.method not in _METHODS:
            continue  # static assets (/console/...) and automatic HEADs
        path = info.get("path") or info["formatter"]
        served.add((str(path), route.method))
    assert served == documented


async def test_unknown_paths_and_methods_answer_with_a_json_error(sqlite_gateway: Gateway) -> None:
    base = f"http://127.0.0.1:{sqlite_gateway.ports['http']}"
    async with aiohttp.ClientSession() as session:
        async with session.get(base + "/api/nothing-here") as response:
            assert response.status == 404
            assert (await response.json())["error"] == "not-found"
        async with session.put(base + "/api/queues") as response:
            assert response.status == 405
            assert (await response.json())["error"] == "method-not-allowed"


async def test_schemathesis_finds_no_server_error_or_undocumented_response(
    sqlite_gateway: Gateway, tmp_path: Path
) -> None:
    schemathesis = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    if schemathesis is None:
        pytest.skip("schemathesis is not installed (it is in the test extra)")
    url = f"http://127.0.0.1:{sqlite_gateway.ports['http']}/api/openapi.json"
    process = await asyncio.create_subprocess_exec(
        schemathesis,
        "run",
        url,
        "--max-examples=25",
        "--seed=1",
        "--workers=1",
        "--phases=examples,coverage,fuzzing",
        "--checks=not_a_server_error,status_code_conformance,content_type_conformance,"
        "response_schema_conformance",
        "--no-color",
        f"--report-dir={tmp_path}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        cwd=tmp_path,
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout=240)
    assert process.returncode == 0, output.decode(errors="replace")[-6000:]
