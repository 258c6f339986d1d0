"""Real SmolLM2 servers with reliability-sized limits (reliability_servers.py), started per test module (or per test
when a test stops its server)."""

import pytest
from reliability_servers import (GRAMMAR_TIMEOUT_S, MAX_BODY_BYTES, MAX_PROMPT_CHARS, MAX_QUEUED, MAX_RUNNING,
                                 start_server)


@pytest.fixture(scope="module")
def front_server():
    """Sized small: prompts of up to 3M characters, 4 MiB bodies, 2 running + 1 queued requests, outlines-core on one
    compile worker (2 compiles at once, 1 of a client's), one more waiting per client. Per module, so that it is gone while the lifecycle and soak modules run servers of their own."""
    srv = start_server("--max-prompt-chars", str(MAX_PROMPT_CHARS), "--max-body-bytes", str(MAX_BODY_BYTES),
                       "--max-running-requests", str(MAX_RUNNING), "--max-queued-requests", str(MAX_QUEUED),
                       "--grammar-max-queued-per-client", "1", "--grammar-timeout-s", str(GRAMMAR_TIMEOUT_S),
                       "--grammar-backend", "outlines", "--grammar-workers", "1")
    yield srv
    srv.stop()
