import pytest
from suite_memory import close_when_leaving_folder

import braid


@pytest.fixture(scope="session")
def runtime(request):
    rt = braid.Runtime(model_path="smollm2", max_total_tokens=8192, log_level="warning")
    close_when_leaving_folder(request, __file__, rt.shutdown)
    yield rt
    rt.shutdown()


@pytest.fixture(scope="session")
def local_engine(request):
    backend = braid.LocalEngine(model_path="smollm2", max_total_tokens=8192, log_level="warning")
    if getattr(backend, "shutdown", None):
        close_when_leaving_folder(request, __file__, backend.shutdown)
    yield backend
    shutdown = getattr(backend, "shutdown", None)
    if shutdown:
        shutdown()
