"""The HTTP backends against a fake server (tests/lang/lang_fake_server.py): request bodies, select's
logprob arithmetic, SSE streaming, errors, Runtime's process handling, and the shared program suite."""

import asyncio
import os
import stat
import sys
from pathlib import Path

import pytest

import braid
from braid.backends.base import CAP_GEN, CAP_IMAGE, CAP_VIDEO, LogprobRequest, Prompt
from braid.backends.runtime import Runtime, server_args_to_cli
from braid.backends.runtime_endpoint import RuntimeEndpoint
from braid.chat_template import CHATML, LLAMA3
from braid.runtime.sampling_params import SamplingParams

from lang_fake_server import REPLY, FakeServer, char_logprob
from test_lang_shared_programs import PROGRAM_NAMES as SHARED_PROGRAMS

HERE = Path(__file__).resolve().parent


@pytest.fixture
def fake():
    server = FakeServer().start()
    yield server
    server.stop()


@pytest.fixture
def endpoint(fake):
    return RuntimeEndpoint(fake.url)


# ---- RuntimeEndpoint ------------------------------------------------------------------------------
def test_generate_request_body_and_result(fake, endpoint):
    sp = SamplingParams().merged(max_new_tokens=5, temperature=0.0, stop=["\n"])
    out = endpoint.generate(Prompt(text="hello", images=("data:image/png;base64,AAAA",)), sp,
                            LogprobRequest(True, 2, 3))
    assert out.text == REPLY[:5] and out.meta_info["prompt_tokens"] == 5
    body = fake.bodies("/generate")[-1]
    assert body["text"] == "hello" and body["image_data"] == ["data:image/png;base64,AAAA"]
    assert body["sampling_params"] == {"max_new_tokens": 5, "temperature": 0.0, "stop": ["\n"]}
    assert (body["return_logprob"], body["logprob_start_len"], body["top_logprobs_num"]) == (True, 2, 3)
    assert len(out.meta_info["input_token_logprobs"]) == 3


def test_select_uses_prefill_then_scores_choice_tokens(fake, endpoint):
    prefix, choices = "Capital: ", ["Paris", "Rome", "Oslo"]
    decision = endpoint.select(Prompt(text=prefix), choices, 0.0, braid.token_length_normalized)
    means = []
    for c in choices:
        text = prefix + c
        means.append(sum(char_logprob(text, i) for i in range(len(prefix), len(text))) / len(c))
    assert decision.scores == pytest.approx(means)
    assert decision.decision == choices[max(range(3), key=lambda i: means[i])]
    assert decision.meta_info["token_logprobs"][0] == pytest.approx(
        [char_logprob(prefix + "Paris", i) for i in range(len(prefix), len(prefix) + 5)])
    bodies = fake.bodies("/generate")
    assert bodies[0] == {"text": prefix, "sampling_params": {"max_new_tokens": 0}}
    scored = bodies[1:]
    assert sorted(b["text"] for b in scored) == sorted(prefix + c for c in choices)
    assert all(b["logprob_start_len"] == len(prefix) - 1 and b["return_logprob"] for b in scored)
    assert all(b["sampling_params"]["max_new_tokens"] == 0 for b in scored)


def test_select_unconditional_requests_choices_alone(fake, endpoint):
    choices = ["yes", "no"]
    d = endpoint.select(Prompt(text="Q? "), choices, 0.0, braid.unconditional_likelihood_normalized)
    # outside a role block the content-free context is a newline (one token), so every choice token scores
    uncond_bodies = [b for b in fake.bodies("/generate") if b["text"] in ("\nyes", "\nno")]
    assert len(uncond_bodies) == 2 and all(b["logprob_start_len"] == 0 for b in uncond_bodies)
    assert d.meta_info["unconditional_token_logprobs"][0] == pytest.approx(
        [char_logprob("\nyes", i) for i in (1, 2, 3)])

    d = endpoint.select(Prompt(text="<|im_start|>assistant\n", open_role="assistant"), choices, 0.0,
                        braid.unconditional_likelihood_normalized)
    assert len(d.meta_info["unconditional_token_logprobs"][1]) == 2


def test_streaming_deltas_concatenate(fake, endpoint):
    pieces = list(endpoint.generate_stream(Prompt(text="x"), SamplingParams()))
    deltas = [d for d, meta in pieces if d]
    assert "".join(deltas) == REPLY and len(deltas) > 1
    assert pieces[-1][1]["completion_tokens"] == len(REPLY)
    assert fake.bodies("/generate")[-1]["stream"] is True


def test_async_generate_and_stream(endpoint):
    async def go():
        out = await endpoint.agenerate(Prompt(text="x"), SamplingParams())
        pieces = [d async for d, _ in endpoint.agenerate_stream(Prompt(text="x"), SamplingParams())]
        return out, pieces

    out, pieces = asyncio.run(go())
    assert out.text == REPLY and "".join(pieces) == REPLY


def test_server_rejection_is_a_value_error(endpoint):
    bad = SamplingParams()
    bad.top_p = 5.0  # the fake server validates like the real one
    with pytest.raises(braid.BackendRequestError, match="top_p") as info:
        endpoint.generate(Prompt(text="x"), bad)
    assert isinstance(info.value, ValueError) and info.value.status == 400


def test_unreachable_server_is_a_backend_error():
    dead = RuntimeEndpoint("http://127.0.0.1:9", timeout=2)
    with pytest.raises(braid.BackendError, match="cannot reach"):
        dead.generate(Prompt(text="x"), SamplingParams())
    assert dead.health(timeout=1) is False
    with pytest.raises(ValueError):
        RuntimeEndpoint("localhost:30000")


def test_model_info_template_routes_and_api_key():
    server = FakeServer(chat_template="{{ '<|start_header_id|>' }}", api_key="sekrit").start()
    try:
        with pytest.raises(braid.BackendRequestError, match="api key"):
            RuntimeEndpoint(server.url).get_model_info()
        ep = RuntimeEndpoint(server.url, api_key="sekrit")
        assert ep.get_chat_template() is LLAMA3
        assert ep.get_server_info()["num_running_reqs"] == 0
        ep.flush_cache()
        assert server.flushes == 1 and ep.health()
        assert RuntimeEndpoint(server.url, api_key="sekrit", chat_template="chatml").get_chat_template() is CHATML
    finally:
        server.stop()


def test_fork_prefills_shared_prefix(fake, endpoint):
    @braid.function
    def prog(s):
        s += "Shared. "
        f = s.fork(2)
        f += braid.gen("x", max_tokens=4)
        f.join()

    prog.run(backend=endpoint)
    first = fake.bodies("/generate")[0]
    assert first == {"text": "Shared. ", "sampling_params": {"max_new_tokens": 0}}


@pytest.mark.parametrize("name", SHARED_PROGRAMS)
def test_shared_programs_on_runtime_endpoint(programs, endpoint, name):
    programs.PROGRAMS[name](endpoint)


# ---- OpenAI ---------------------------------------------------------------------------------------
def test_openai_chat_messages_and_extra_body(fake):
    backend = braid.OpenAI("smollm2", base_url=fake.url + "/v1", api_key="k")

    @braid.function
    def prog(s):
        s += braid.system("S")
        s += braid.user("U")
        s += braid.assistant(braid.gen("a", max_tokens=20, top_k=5, stop="\n"))
        s += braid.user("number?")
        s += braid.assistant(braid.gen("n", regex=r"\d\d"))

    state = prog.run(backend=backend)
    assert state["a"] == "chat reply" and state["n"] == "00"
    first, second = fake.bodies("/v1/chat/completions")
    assert first["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert first["max_tokens"] == 20 and first["top_k"] == 5 and first["stop"] == ["\n"]
    assert second["regex"] == r"\d\d" and len(second["messages"]) == 4


def test_openai_chat_select_is_constrained(fake):
    backend = braid.OpenAI("smollm2", base_url=fake.url + "/v1", api_key="k")

    @braid.function
    def prog(s):
        s += braid.user("pick")
        s += braid.assistant(braid.select("c", ["a.b", "c"]))

    assert prog.run(backend=backend)["c"] == "a.b"
    assert fake.bodies("/v1/chat/completions")[0]["regex"] == r"(a\.b|c)"

    rf_backend = braid.OpenAI("smollm2", base_url=fake.url + "/v1", api_key="k", constrained="response_format")
    assert prog.run(backend=rf_backend)["c"] == "a.b"
    rf = fake.bodies("/v1/chat/completions")[1]["response_format"]
    assert rf["json_schema"]["schema"]["properties"]["choice"]["enum"] == ["a.b", "c"]

    @braid.function
    def greedy(s):
        s += braid.user("pick")
        s += braid.assistant(braid.select("c", ["a", "b"], choices_method=braid.greedy_token_selection))

    with pytest.raises(braid.UnsupportedFeatureError, match="choices_methods"):
        greedy.run(backend=backend)


def test_openai_chat_program_shape_errors(fake):
    backend = braid.OpenAI("smollm2", base_url=fake.url + "/v1", api_key="k")

    @braid.function
    def outside(s):
        s += braid.user("hi") + braid.gen("x")

    with pytest.raises(braid.ProgramError, match="inside an assistant"):
        outside.run(backend=backend)

    @braid.function
    def partial(s):
        s += braid.user("hi") + braid.assistant("Sure: " + braid.gen("x"))

    with pytest.raises(braid.ProgramError, match="partly written"):
        partial.run(backend=backend)

    no_constraints = braid.OpenAI("smollm2", base_url=fake.url + "/v1", api_key="k", constrained=None)

    @braid.function
    def sel(s):
        s += braid.user("hi") + braid.assistant(braid.select("x", ["a", "b"]))

    with pytest.raises(braid.UnsupportedFeatureError, match="select"):
        sel.run(backend=no_constraints)


def test_openai_completion_model_select_from_echo_logprobs(fake):
    backend = braid.OpenAI("m", base_url=fake.url + "/v1", api_key="k", is_chat_model=False)

    @braid.function
    def prog(s):
        s += "Answer: " + braid.select("c", ["Paris", "Rome"], choices_method=braid.greedy_token_selection)
        s += " " + braid.gen("g", max_tokens=8)

    state = prog.run(backend=backend)
    prefix = "Answer: "
    lps = {c: [char_logprob(prefix + c, i) for i in range(len(prefix), len(prefix) + len(c))] for c in ["Paris", "Rome"]}
    assert state.get_meta_info("c")["token_logprobs"] == [pytest.approx(lps["Paris"]), pytest.approx(lps["Rome"])]
    assert state["c"] in ("Paris", "Rome")
    echo = fake.bodies("/v1/completions")[0]
    assert echo["echo"] is True and echo["max_tokens"] == 0
    assert state["g"] == "completi"
    assert fake.bodies("/v1/completions")[-1]["prompt"] == prefix + state["c"] + " "


def test_openai_streaming(fake):
    backend = braid.OpenAI("smollm2", base_url=fake.url + "/v1", api_key="k")

    @braid.function
    def prog(s):
        s += braid.user("hi")
        s += braid.assistant(braid.gen("a"))

    state = prog.run(backend=backend, stream=True)
    assert list(state.text_iter("a")) == ["cha", "t r", "epl", "y"]


@pytest.mark.parametrize("name", SHARED_PROGRAMS)
def test_shared_programs_on_openai_chat(programs, fake, name):
    programs.PROGRAMS[name](braid.OpenAI("smollm2", base_url=fake.url + "/v1", api_key="k"))


# ---- Runtime --------------------------------------------------------------------------------------
def test_server_args_to_cli():
    assert server_args_to_cli({"model_path": "m", "max_total_tokens": 4096, "disable_radix_cache": True,
                               "enable_torch_compile": False, "api_key": None, "stop": ["a", "b"],
                               "model_config": {"x": 1}}) == [
        "--model-path", "m", "--max-total-tokens", "4096", "--disable-radix-cache", "--stop", "a", "b",
        "--model-config", '{"x": 1}']


def test_runtime_reports_server_death_with_log_tail():
    with pytest.raises(braid.ServerStartError, match="unrecognized arguments") as info:
        Runtime(model_path="smollm2", no_such_option=1, startup_timeout=60)
    assert "exited with code" in str(info.value)
    log_path = str(info.value).split("log tail (")[1].split(")")[0]
    assert os.path.exists(log_path)
    os.unlink(log_path)


def test_runtime_spawns_waits_and_shuts_down(tmp_path, programs):
    launcher = tmp_path / "fake_python"
    launcher.write_text(f"#!{sys.executable}\n"
                        "import runpy, sys\n"
                        f"sys.argv = [{str(HERE / 'lang_fake_server.py')!r}] + sys.argv[3:]\n"
                        f"runpy.run_path({str(HERE / 'lang_fake_server.py')!r}, run_name='__main__')\n")
    launcher.chmod(launcher.stat().st_mode | stat.S_IEXEC)
    runtime = Runtime(model_path="smollm2", python=str(launcher), max_total_tokens=1024, startup_timeout=60)
    try:
        assert runtime.alive and runtime.url.startswith("http://127.0.0.1:")
        assert "--max-total-tokens" in runtime.command and runtime.command[1:3] == ["-m", "braid.launch_server"]
        programs.program_few_shot_qa(runtime)
        assert isinstance(runtime.endpoint, RuntimeEndpoint)
        assert "fake server on" in runtime.log_tail()
    finally:
        runtime.shutdown()
    assert not runtime.alive and not os.path.exists(runtime.log_path)
    runtime.shutdown()  # idempotent


# ---- LocalEngine (with a stand-in engine: no torch) ------------------------------------------------
class _StubEngine:
    """Engine-shaped: generate(prompt=..., ...) answering like the fake server; stream -> iterator."""

    def __init__(self):
        self.fake = FakeServer()  # never started: only its answer logic is used
        self.calls = []
        self.flushed = False

    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 logprob_start_len=-1, top_logprobs_num=0, stream=False, rid=None):
        self.calls.append({"prompt": prompt, "sampling_params": sampling_params, "stream": stream})
        body = {"text": prompt, "sampling_params": sampling_params, "return_logprob": return_logprob,
                "logprob_start_len": logprob_start_len, "stream": stream}
        out = self.fake.generate(body)
        return iter(out) if stream else out

    def flush_cache(self):
        self.flushed = True

    def get_stats(self):
        return {"num_running_reqs": 0}


def test_image_capability_follows_the_served_model(fake, endpoint):
    @braid.function
    def with_image(s):
        s += braid.user(braid.image(_tiny_png()) + "what?")
        s += braid.assistant(braid.gen("a", max_tokens=4))

    assert endpoint.supports(CAP_GEN) and not endpoint.supports(CAP_IMAGE) and not endpoint.supports(CAP_VIDEO)
    with pytest.raises(braid.UnsupportedFeatureError, match="the served model fake-model takes no image input"):
        with_image.run(backend=endpoint)
    assert not fake.bodies("/generate")
    multimodal = RuntimeEndpoint(fake.url)
    multimodal._model_info = {"model_path": "llava", "is_multimodal": True}
    assert multimodal.supports(CAP_IMAGE) and multimodal.supports(CAP_VIDEO)


def test_local_engine_adapts_to_the_engine_signature(programs):
    local = braid.LocalEngine("smollm2", max_total_tokens=1024)
    assert local.server_args == {"max_total_tokens": 1024} and "not loaded" in repr(local)
    local._engine = _StubEngine()
    for name in ("few_shot_qa", "select", "streaming", "fork_branches"):
        programs.PROGRAMS[name](local)
    assert local._engine.calls and all(isinstance(c["prompt"], str) for c in local._engine.calls)
    assert local.get_chat_template() is CHATML
    assert local.get_server_info() == {"num_running_reqs": 0}
    local.flush_cache()
    assert local._engine.flushed

    @braid.function
    def with_image(s):
        s += braid.user(braid.image(_tiny_png()) + "what?")
        s += braid.assistant(braid.gen("a"))

    with pytest.raises(braid.UnsupportedFeatureError, match="image"):
        with_image.run(backend=local)


def _tiny_png():
    import io

    from PIL import Image as PILImage

    buf = io.BytesIO()
    PILImage.new("RGB", (2, 2)).save(buf, format="PNG")
    return buf.getvalue()
