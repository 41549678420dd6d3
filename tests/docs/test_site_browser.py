"""The docs site, built with `mkdocs build --strict` and opened in headless Chromium: the index, API reference and
performance pages load from a loopback server, show their text, and render every plot image (naturalWidth > 0).

Chromium is Debian's (`scripts/setup.sh` installs it as root), driven through Playwright without `playwright install`.
It skips, saying why, only where Chromium is absent; under CI (CI=true) a missing Chromium is a failure.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PAGES = {  # page -> (text it must show, least number of plot images)
    "": ("fast dynamic LoRA", 1),
    "reference/api/": ("fdlora.set_adapters", 1),
    "performance/": ("Method", 4),
}


def _need(ok: bool, why: str) -> None:
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"{why} (CI must run the docs browser test: scripts/setup.sh installs it as root)")
        pytest.skip(why)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    _need(shutil.which("mkdocs") is not None or _has("mkdocs"), "mkdocs is not installed: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=os.environ | {"NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    return out


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="module")
def base_url(site):
    handler = functools.partial(_Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep the test output clean
        pass


def test_site_has_the_pages(site):
    for page in PAGES:
        assert (site / page / "index.html").is_file(), page
    assert (site / "reference" / "training-yaml" / "index.html").is_file()  # generated from the schema


def test_pages_render_their_plots_in_chromium(base_url, tmp_path):
    _need(_has("playwright"), "playwright is not installed: pip install -e '.[dev]'")
    _need(os.access(CHROMIUM, os.X_OK), f"{CHROMIUM} is missing: apt-get install chromium (scripts/setup.sh as root)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM,
                                                   args=ARGS, headless=True, viewport={"width": 1280, "height": 900})
        try:
            ctx.route(re.compile(r"^https?://(?!127\.0\.0\.1)"), lambda r: r.abort())  # loopback only
            page = ctx.new_page()
            for path, (text, least) in PAGES.items():
                resp = page.goto(base_url + path, wait_until="load")
                assert resp is not None and resp.ok, path
                assert text in page.inner_text("article"), f"{path}: no '{text}'"
                images = page.eval_on_selector_all(
                    "article img[src*='assets/']",
                    "els => els.map(e => ({src: e.getAttribute('src'), complete: e.complete, w: e.naturalWidth}))")
                assert len(images) >= least, f"{path}: {len(images)} plot images, expected at least {least}"
                broken = [im["src"] for im in images if not (im["complete"] and im["w"] > 0)]
                assert not broken, f"{path}: images that did not render: {broken}"
            page.screenshot(path=str(tmp_path / "performance.png"), full_page=False)
        finally:
            ctx.close()
