"""The demo in a real headless Chromium: tick an adapter off, move a slider, press Generate, and see
the displayed weights and the image change. Saves a screenshot as a test artifact (path printed)."""

from __future__ import annotations

import os
import re

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-quic"]

pytest.importorskip("playwright", reason="playwright is not installed: bash scripts/setup.sh")
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium, or run scripts/setup.sh as root)",
                allow_module_level=True)


def test_toggle_slider_generate(demo_url, tmp_path_factory):
    from playwright.sync_api import expect, sync_playwright

    shot = tmp_path_factory.mktemp("demo-artifacts") / "demo_browser.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.route(re.compile(r"^https?://(?!127\.0\.0\.1)"), lambda r: r.abort())  # loopback only
            page.goto(demo_url, wait_until="domcontentloaded")
            status, image = page.locator("#status textarea"), page.locator("#image img")

            page.locator("#go").click()
            expect(status).to_have_value(re.compile(r"pixel=1\.00, watercolor=1\.00 \| step"), timeout=30_000)
            expect(image).to_be_visible()
            before = image.screenshot()

            page.get_by_role("checkbox", name="watercolor", exact=True).uncheck()
            expect(status).to_have_value(re.compile(r"^active: pixel=1\.00 \| set_adapters"))
            slider = page.get_by_role("slider", name="range slider for pixel weight")
            slider.focus()
            for _ in range(4):
                page.keyboard.press("ArrowLeft")  # 1.00 -> 0.80 in steps of 0.05
            expect(status).to_have_value(re.compile(r"^active: pixel=0\.80 \| set_adapters [0-9.]+ ms"))

            page.locator("#go").click()
            expect(status).to_have_value(re.compile(r"^active: pixel=0\.80 \| step [0-9.]+ ms"), timeout=30_000)
            page.wait_for_timeout(300)  # let the new image paint
            assert image.screenshot() != before, "the image did not change with the weights"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    print(f"\nscreenshot: {shot}")
    assert shot.stat().st_size > 10_000
