"""Fixtures for the browser tests: the system Chromium, driven by Playwright.

Playwright cannot download its own browsers on the test machines, so it drives
Debian's ``chromium`` (or the one ``CHROMIUM`` names). Without Playwright or a
Chromium the browser tests are skipped in one line: the rest of the suite needs
neither. Registered in ``conftest.py`` through ``pytest_plugins``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page


# Per module, not per session: between its calls the sync API leaves its event loop marked as running in the
# main thread, so while it is up every asyncio.run() there fails (test_async, test_docs). Starting it takes ~0.5s.
@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """A headless Chromium for the test module; each test isolates itself in ``page``."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("no Playwright: pip install playwright (browser tests need it)")
    # A CHROMIUM set to a missing path skips rather than quietly testing another browser.
    executable = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not os.access(executable, os.X_OK):
        pytest.skip(f"no Chromium at {executable}: apt-get install chromium (browser tests need it)")
    with sync_playwright() as playwright:
        # Chromium's sandbox refuses to start as root, which is how CI runs.
        browser = playwright.chromium.launch(executable_path=executable, headless=True, chromium_sandbox=False)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A page in a context of its own, so no cookies or storage carry over from another test."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    yield context.new_page()
    context.close()
