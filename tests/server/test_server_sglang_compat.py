"""SGLang v0.3's routes and names on the session server: GET and POST /flush_cache, /get_server_args,
model="default" on the OpenAI routes."""

from server_helpers import API_KEY


def test_flush_cache_on_get_and_post(server):
    for send in (server.get, server.post):
        r = send("/flush_cache")
        assert r.status_code == 200 and r.json()["success"] is True, r.text


def test_get_server_args_is_the_public_args_part_of_server_info(server):
    args = server.get("/get_server_args").json()
    info = server.get("/get_server_info").json()
    assert args["api_key"] == "<redacted>" and API_KEY not in server.get("/get_server_args").text
    assert args["api_key_set"] is True
    assert args["max_total_tokens"] == 16384 and args["model_path"] == "smollm2"
    # /get_server_info reports the model's resolved context length; the argument itself was not given
    assert args["context_length"] is None and info["context_length"] > 0
    assert {k: info[k] for k in args if k != "context_length"} == {k: v for k, v in args.items() if k != "context_length"}
    assert "num_running_reqs" not in args


def test_get_server_args_needs_the_api_key(server):
    assert server.get("/get_server_args", headers={}).status_code == 401


def test_model_default_through_the_openai_client(openai_client):
    chat = openai_client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=3, temperature=0)
    assert chat.model == "smollm2" and chat.choices[0].message.content is not None
    completion = openai_client.completions.create(model="default", prompt="The capital of France is",
                                                  max_tokens=3, temperature=0)
    assert completion.model == "smollm2" and completion.choices[0].text


def test_unknown_model_is_still_404(server):
    r = server.post("/v1/completions", json={"model": "nope", "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 404
