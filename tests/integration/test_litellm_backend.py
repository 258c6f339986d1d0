"""braid.LiteLLM against braid's own /v1 through LiteLLM's OpenAI-compatible route (`openai/<model>` with
api_base) on the real SmolLM2 server: shared programs, streaming, token counts equal to the server's."""

import os
import sys

import pytest

import braid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
from programs import PROGRAMS, supported_programs  # noqa: E402

PROGRAMS_RUN = ["few_shot_qa", "streaming", "fork_by_index", "api_speculative"]


@pytest.fixture(scope="module")
def litellm_backend(runtime):
    return braid.LiteLLM("openai/smollm2", api_base=runtime.url + "/v1", api_key="unused")


@pytest.mark.parametrize("program", PROGRAMS_RUN)
def test_shared_program_through_litellm(litellm_backend, program):
    assert program in supported_programs(litellm_backend)
    PROGRAMS[program](litellm_backend)


def test_unsupported_programs_fail_clearly(litellm_backend):
    unsupported = set(PROGRAMS) - set(supported_programs(litellm_backend))
    assert {"select", "json_extraction", "regex_gen", "typed_gen"} <= unsupported
    with pytest.raises(braid.UnsupportedFeatureError, match="support"):
        PROGRAMS["select"](litellm_backend)


@braid.function
def two_turns(s):
    s += braid.user("Name a planet.")
    s += braid.assistant(braid.gen("a", max_tokens=12, temperature=0))
    s += braid.user("Name a star.")
    s += braid.assistant(braid.gen("b", max_tokens=12, temperature=0))


def test_token_usage_matches_the_server(runtime, litellm_backend):
    usage = litellm_backend.token_usage
    usage.reset()
    before = runtime.endpoint.get_server_info()
    state = two_turns.run(backend=litellm_backend)
    after = runtime.endpoint.get_server_info()
    assert state["a"] and state["b"]
    assert usage.prompt_tokens == after["num_prompt_tokens_total"] - before["num_prompt_tokens_total"]
    assert usage.completion_tokens == after["num_generated_tokens_total"] - before["num_generated_tokens_total"]
    assert 0 < usage.completion_tokens <= 24
