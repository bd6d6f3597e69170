"""The web console in a real browser (headless Chromium from Debian's packages, driven by
Selenium): an operator watches a consumer's partitions go ``unbound`` during the rebalance
delay and then move to the consumer that is left.

Skipped, with the reason, where Chromium or its driver is not installed (scripts/test.sh
installs both). ``KEYGATE_CONSOLE_SCREENSHOT=path.png`` saves the page as the README shows it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gateway.client import Client
from gateway.server import Gateway
from tests.integration.conftest import native_url
from tests.support.wait import eventually

webdriver = pytest.importorskip("selenium.webdriver")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture
def browser() -> Iterator[Any]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip(
            "Chromium and chromedriver are not installed (apt-get install chromium "
            "chromium-driver; scripts/test.sh does it)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=webdriver.ChromeService(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


_READ_MAP = """
return Array.from(document.querySelectorAll('.group[data-group=billing] .partition'),
                  (tile) => tile.innerText);
"""


def _tiles(driver: Any) -> dict[int, tuple[str, str]]:
    """Partition number -> (state, owner) as the page shows them in its map, read in one
    script call (the page redraws while Selenium would walk its elements)."""
    out = {}
    for text in driver.execute_script(_READ_MAP):
        lines = text.splitlines()  # "P2 · ready", owner, backlog, in flight
        number, state = lines[0].removeprefix("P").split(" · ")
        out[int(number)] = (state, lines[1])
    return out


async def _page_shows(driver: Any, check: Callable[[dict[int, tuple[str, str]]], bool]) -> Any:
    async def probe() -> dict[int, tuple[str, str]] | None:
        tiles = await asyncio.to_thread(_tiles, driver)
        return tiles if check(tiles) else None

    return await eventually(probe, timeout=15, interval=0.1)


async def test_console_shows_unbound_partitions_during_the_rebalance_delay_then_the_new_owner(
    sqlite_gateway: Gateway, browser: Any
) -> None:
    async with Client(native_url(sqlite_gateway)) as admin:
        await admin.declare_queue("orders", partitions=4, rebalance_delay=3.0)
        for n in range(20):
            await admin.publish("orders", b"x", key=f"k{n}")
    a_client = await Client(native_url(sqlite_gateway), client_name="consumer-a").connect()
    b_client = await Client(native_url(sqlite_gateway), client_name="consumer-b").connect()
    a = await a_client.subscribe("orders", group="billing", window=1)
    b = await b_client.subscribe("orders", group="billing", window=1)
    await eventually(lambda: len(a.partitions) == 2 and len(b.partitions) == 2)
    b_parts = set(b.partitions)

    url = f"http://127.0.0.1:{sqlite_gateway.ports['http']}/?interval=200#queue=orders"
    await asyncio.to_thread(browser.get, url)
    await _page_shows(
        browser,
        lambda t: (
            len(t) == 4
            and {p for p, (s, o) in t.items() if s == "ready" and o == "consumer-b"} == b_parts
        ),
    )
    row = await asyncio.to_thread(
        browser.execute_script,
        "return document.querySelector('#queues tr[data-queue=orders]').innerText",
    )
    assert row.split()[:3] == ["orders", "4", "20"]  # name, partitions, depth
    b_client.abort()  # a crash: the partitions wait through the rebalance delay
    unbound = await _page_shows(
        browser, lambda t: {p for p, (s, _) in t.items() if s == "unbound"} == b_parts
    )
    assert all(unbound[p][1] in ("consumer-b", "—") for p in b_parts)
    if path := os.environ.get("KEYGATE_CONSOLE_SCREENSHOT"):
        await asyncio.to_thread(browser.save_screenshot, path)
    await _page_shows(
        browser, lambda t: len(t) == 4 and all(v == ("ready", "consumer-a") for v in t.values())
    )
    await a_client.close()


async def test_a_refresh_period_that_is_not_one_is_the_default(
    sqlite_gateway: Gateway, browser: Any
) -> None:
    """?interval=abc or 0 used to poll the API as fast as the browser could."""
    base = f"http://127.0.0.1:{sqlite_gateway.ports['http']}/"
    for asked, used in (("abc", 1000), ("0", 1000), ("-5", 1000), ("20", 100), ("250", 250)):
        await asyncio.to_thread(browser.get, f"{base}?interval={asked}")
        assert await asyncio.to_thread(browser.execute_script, "return POLL_MS") == used, asked


async def test_console_page_and_assets_are_served_from_the_package(sqlite_gateway: Gateway) -> None:
    import aiohttp

    base = f"http://127.0.0.1:{sqlite_gateway.ports['http']}"
    async with aiohttp.ClientSession() as session:
        for path, kind in (
            ("/", "text/html"),
            ("/console/console.js", "javascript"),
            ("/console/console.css", "text/css"),
        ):
            async with session.get(base + path) as response:
                assert response.status == 200
                assert kind in response.headers["Content-Type"]
                assert "http://" not in (await response.text()).replace(base, "")
