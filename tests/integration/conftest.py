import pytest

import braid


@pytest.fixture(scope="session")
def runtime():
    rt = braid.Runtime(model_path="smollm2", max_total_tokens=32768, log_level="warning")
    yield rt
    rt.shutdown()


@pytest.fixture(scope="session")
def local_engine():
    backend = braid.LocalEngine(model_path="smollm2", max_total_tokens=16384, log_level="warning")
    yield backend
    shutdown = getattr(backend, "shutdown", None)
    if shutdown:
        shutdown()
