"""A headless Chromium (driven over the DevTools protocol) and one real SmolLM2 server for this folder. A missing
browser fails the tests: .ci/run installs Debian's chromium."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cdp import Browser, find_chromium  # noqa: E402
from real_server import start_server  # noqa: E402
from suite_memory import close_when_leaving_folder  # noqa: E402

API_KEY = "browser-key"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SCREENSHOT_DIR_ENV = "BRAID_SCREENSHOT_DIR"  # docs/images is written by running these tests with it set

SERVER_FLAGS = ["--model-path", "smollm2", "--max-total-tokens", "8192", "--api-key", API_KEY,
                "--log-level", "warning"]


@pytest.fixture(scope="session")
def browser(request):
    executable = find_chromium()
    if executable is None:
        pytest.fail("no chromium on PATH: install it (apt-get install -y chromium; .ci/run does)")
    b = Browser(executable)
    close_when_leaving_folder(request, __file__, b.close)
    yield b
    b.close()


@pytest.fixture
def page(browser):
    p = browser.new_page()
    yield p
    p.close()


@pytest.fixture(scope="session")
def server(request):
    srv = start_server(SERVER_FLAGS, API_KEY, "braid-browser-server-")
    close_when_leaving_folder(request, __file__, srv.stop)
    yield srv
    srv.stop()


def keep_screenshot(png: bytes, name: str) -> None:
    """Checks that a page screenshot came back as a real PNG; writes it to $BRAID_SCREENSHOT_DIR/name when set."""
    assert png.startswith(PNG_SIGNATURE) and len(png) > 20_000
    folder = os.environ.get(SCREENSHOT_DIR_ENV)
    if folder:
        with open(os.path.join(folder, name), "wb") as f:
            f.write(png)
