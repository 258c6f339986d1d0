"""/metrics in Prometheus text format (prometheus-client), with vLLM's metric names under the braid: prefix: the
unit-level exposition, then a real server whose counters move as the requests of this module finish."""

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from real_server import start_server
from server_helpers import metric_values

from braid.runtime.server.metrics import ServerMetrics

API_KEY = "metrics-key"
FLAGS = ["--max-total-tokens", "4096", "--api-key", API_KEY, "--log-level", "warning"]

VLLM_FAMILIES = ["time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prompt_tokens", "request_generation_tokens", "request_params_n",
                 "request_params_best_of", "request_success", "num_requests_running", "num_requests_waiting",
                 "gpu_cache_usage_perc", "gpu_prefix_cache_hit_rate", "prompt_tokens", "generation_tokens",
                 "num_preemptions"]


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_exposition_parses_and_names_follow_vllm():
    m = ServerMetrics("smol")
    m.observe_first_token(0.03)
    m.observe_tokens(0.02, 2)
    m.observe_choice(7, 3, "length")
    m.observe_choice(7, 1, "abort")
    m.observe_request(1.0, 7, 0.2, n=1, best_of=2)
    text = m.render({"num_running_reqs": 2, "num_waiting_reqs": 1, "kv_used_tokens": 10, "kv_total_tokens": 40,
                     "cache_hit_rate": 0.5, "num_prompt_tokens_total": 7, "num_generated_tokens_total": 9,
                     "num_retractions": 0}).decode()
    fams = families(text)
    for name in VLLM_FAMILIES:
        assert "braid:" + name in fams, name
    values = metric_values(text)
    assert values["braid:num_requests_running"] == 2 and values["braid:gpu_cache_usage_perc"] == 0.25
    assert values["braid:gpu_prefix_cache_hit_rate"] == 0.5 and values["braid:prompt_tokens_total"] == 7
    assert values['braid:time_to_first_token_seconds_bucket{le="0.02"}'] == 0
    assert values['braid:time_to_first_token_seconds_bucket{le="0.04"}'] == 1
    assert values["braid:time_per_output_token_seconds_count"] == 2
    assert values["braid:time_per_output_token_seconds_sum"] == pytest.approx(0.02)
    success = {s.labels["finished_reason"]: s.value for s in fams["braid:request_success"].samples
               if s.name.endswith("_total")}
    assert success == {"stop": 0, "length": 1, "abort": 1}
    assert all(s.labels.get("model_name") == "smol" for f in fams.values() for s in f.samples)
    assert 'braid:model_info{model_name="smol"} 1.0' in text
    assert m.render(None)  # scheduler gone: the server's own metrics still render


@pytest.fixture(scope="module")
def server():
    srv = start_server(FLAGS, API_KEY, "braid-metrics-")
    yield srv
    srv.stop()


def test_every_request_records_ttft_tpot_queue_and_tokens(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    before = metric_values(server.get("/metrics").text)
    assert before.get("braid:time_to_first_token_seconds_count", 0) == 0
    r = client.completions.create(model="default", prompt="Once upon a time", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})  # not streamed
    assert r.usage.completion_tokens == 6
    after = metric_values(server.get("/metrics").text)
    assert after["braid:time_to_first_token_seconds_count"] == 1  # a non-streamed request has a TTFT too
    assert 0 < after["braid:time_to_first_token_seconds_sum"] < after["braid:e2e_request_latency_seconds_sum"]
    assert after["braid:time_per_output_token_seconds_count"] == 5
    assert after["braid:request_queue_time_seconds_count"] == 1
    assert after["braid:request_generation_tokens_sum"] == 6
    assert after["braid:request_prompt_tokens_sum"] == r.usage.prompt_tokens
    assert after["braid:generation_tokens_total"] >= 6

    chunks = list(client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, temperature=0, stream=True))
    assert chunks
    client.completions.create(model="default", prompt="Count:", max_tokens=3, n=2, temperature=1.0,
                              extra_body={"best_of": 3})
    text = server.get("/metrics").text
    values = metric_values(text)
    assert values["braid:time_to_first_token_seconds_count"] == 3
    assert values["braid:e2e_request_latency_seconds_count"] == 3
    success = {s.labels["finished_reason"]: s.value for s in families(text)["braid:request_success"].samples
               if s.name.endswith("_total")}
    assert sum(success.values()) == 1 + 1 + 3 and success["length"] >= 2
    assert values["braid:request_params_n_sum"] == 1 + 1 + 2
    assert values["braid:request_params_best_of_sum"] == 1 + 1 + 3
    assert values["braid:num_requests_running"] == 0 and values["braid:num_requests_waiting"] == 0
    assert 0 <= values["braid:gpu_cache_usage_perc"] <= 1 and 0 <= values["braid:gpu_prefix_cache_hit_rate"] <= 1
