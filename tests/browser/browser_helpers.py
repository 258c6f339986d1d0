"""What the browser tests share besides their fixtures: the server's key and flags, and the screenshot check (imported
by this module's name; the fixtures are conftest.py's)."""

import os

API_KEY = "browser-key"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SCREENSHOT_DIR_ENV = "BRAID_SCREENSHOT_DIR"  # docs/images is written by running these tests with it set

SERVER_FLAGS = ["--model-path", "smollm2", "--max-total-tokens", "8192", "--api-key", API_KEY,
                "--log-level", "warning"]


def keep_screenshot(png: bytes, name: str) -> None:
    """Checks that a page screenshot came back as a real PNG; writes it to $BRAID_SCREENSHOT_DIR/name when set."""
    assert png.startswith(PNG_SIGNATURE) and len(png) > 20_000
    folder = os.environ.get(SCREENSHOT_DIR_ENV)
    if folder:
        with open(os.path.join(folder, name), "wb") as f:
            f.write(png)
