"""One real server process on SmolLM2 for this folder (started on first use, stopped after its last test), plus
clients."""

import pytest
from real_server import start_server
from server_helpers import API_KEY, SERVER_FLAGS
from suite_memory import close_when_leaving_folder


@pytest.fixture(scope="session")
def server(request):
    srv = start_server(SERVER_FLAGS, API_KEY, "braid-server-")
    close_when_leaving_folder(request, __file__, srv.stop)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model_name(server):
    return server.get("/v1/models").json()["data"][0]["id"]
