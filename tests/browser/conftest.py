"""A headless Chromium (driven over the DevTools protocol) and one real SmolLM2 server for this folder. A missing
browser fails the tests: .ci/run installs Debian's chromium."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cdp import Browser, find_chromium  # noqa: E402
from real_server import start_server  # noqa: E402
from suite_memory import close_when_leaving_folder  # noqa: E402

from browser_helpers import API_KEY, SERVER_FLAGS  # noqa: E402

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
