"""The CPU KV pool's default size from MemAvailable, the periodic stats line, and the weight count from headers."""

import logging

import torch

from braid.runtime.model_executor.model_runner import cpu_default_kv_tokens
from braid.runtime.scheduler.stats_log import ServingStatsLog

GiB = 2**30


def test_cpu_kv_pool_is_a_tenth_of_available_memory_within_bounds():
    per_token = 46080  # SmolLM2-135M in fp32: 30 layers * (K + V) * 3 KV heads * 64 dims * 4 bytes
    assert cpu_default_kv_tokens(64 * GiB, per_token) == 65536  # capped
    assert cpu_default_kv_tokens(20 * GiB, per_token) == int(2 * GiB) // per_token  # 10%: 46603 tokens
    assert cpu_default_kv_tokens(1 * GiB, per_token) == 4096  # floored
    assert cpu_default_kv_tokens(0, per_token) == 4096
    assert cpu_default_kv_tokens(None, per_token) == 65536  # unknown (not Linux): today's figure


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class FakeScheduler:
    def __init__(self):
        self.stats = dict(num_running_reqs=0, num_waiting_reqs=0, num_generated_tokens_total=0,
                          num_computed_prompt_tokens_total=0, kv_used_tokens=0, kv_total_tokens=4096,
                          cache_hit_rate=0.0)
        self.calls = 0

    def get_stats(self):
        self.calls += 1
        return dict(self.stats)


def test_stats_line_at_most_once_per_interval_with_rates_since_the_last(caplog):
    clock, sched = FakeClock(), FakeScheduler()
    log = ServingStatsLog(2.0, clock)
    caplog.set_level(logging.INFO, logger="braid.stats")
    assert log.maybe_log(sched) is None  # the first call sets the baseline
    sched.stats.update(num_running_reqs=3, num_waiting_reqs=1, num_computed_prompt_tokens_total=400,
                       num_generated_tokens_total=50, kv_used_tokens=1024, cache_hit_rate=0.25)
    clock.now += 1.0
    calls = sched.calls
    assert log.maybe_log(sched) is None and sched.calls == calls  # not due: no get_stats either
    clock.now += 1.0
    line = log.maybe_log(sched)
    assert line == ("stats: #running-req: 3, #queue-req: 1, prefill: 200.0 tok/s, decode: 25.0 tok/s, "
                    "KV usage: 25.0% (1024/4096 tokens), cache hit rate: 25.0%")
    assert [r.getMessage() for r in caplog.records] == [line]
    sched.stats.update(num_generated_tokens_total=90)
    clock.now += 2.0
    assert "prefill: 0.0 tok/s, decode: 20.0 tok/s" in log.maybe_log(sched)


def test_stats_line_silent_when_idle_or_turned_off():
    clock, sched = FakeClock(), FakeScheduler()
    log = ServingStatsLog(1.0, clock)
    for _ in range(5):
        assert log.maybe_log(sched) is None
        clock.now += 1.5
    off = ServingStatsLog(0.0, clock)
    sched.stats.update(num_running_reqs=2, num_generated_tokens_total=10)
    for _ in range(3):
        clock.now += 100
        assert off.maybe_log(sched) is None
    assert sched.calls == 5


def test_safetensors_tensor_count_reads_only_the_headers(tmp_path):
    from safetensors.torch import save_file

    from braid.runtime.loader.hf import safetensors_tensor_count

    save_file({"a": torch.zeros(2), "b": torch.ones(3, 3)}, str(tmp_path / "model-00001.safetensors"),
              metadata={"format": "pt"})
    save_file({"c": torch.zeros(1)}, str(tmp_path / "model-00002.safetensors"))
    assert safetensors_tensor_count(str(tmp_path)) == 3
