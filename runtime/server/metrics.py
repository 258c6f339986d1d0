"""Prometheus metrics (prometheus-client, text format 0.0.4), named like vLLM's with the `braid:` prefix.

Per-request histograms and counters are observed in the server process as requests finish (latencies the server
cannot see for a non-streamed request, such as its first token or its time in the queue, come with the scheduler's
final output). Gauges and token totals come from the scheduler's `get_stats()` at scrape time. docs/api.md lists
every name and its vLLM counterpart.
"""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "braid:"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                            240.0, 480.0, 960.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_N_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 128)
FINISH_REASONS = ("stop", "length", "abort")

# scheduler stats key -> (gauge name, help)
_STAT_GAUGES = {
    "num_running_reqs": ("num_requests_running", "Requests being prefilled or decoded"),
    "num_waiting_reqs": ("num_requests_waiting", "Requests waiting to be scheduled (including grammar compiles)"),
    "kv_used_tokens": ("kv_used_tokens", "KV cache slots held by live requests"),
    "kv_total_tokens": ("kv_total_tokens", "KV cache size in tokens"),
    "cache_hit_rate": ("gpu_prefix_cache_hit_rate", "Fraction of prompt tokens served from the radix (prefix) cache"),
    # LoRA adapters (only with --enable-lora)
    "lora_free_slots": ("lora_free_slots", "LoRA adapter device slots holding no adapter"),
}
# cumulative scheduler totals -> (counter name without _total, help)
_STAT_COUNTERS = {
    "num_prompt_tokens_total": ("prompt_tokens", "Prompt tokens received"),
    "num_generated_tokens_total": ("generation_tokens", "Tokens generated"),
    "num_cached_tokens_total": ("cached_prompt_tokens", "Prompt tokens served from the radix cache"),
    "num_computed_prompt_tokens_total": ("computed_prompt_tokens", "Prompt tokens run through the model"),
    "num_retractions": ("num_preemptions", "Requests taken out of the running batch when the KV cache ran out"),
    # speculative decoding (only while --speculative-algorithm is set)
    "spec_num_drafts_total": ("spec_decode_num_drafts", "Drafts verified (one per request with a draft per pass)"),
    "spec_num_draft_tokens_total": ("spec_decode_num_draft_tokens", "Draft tokens verified"),
    "spec_num_accepted_tokens_total": ("spec_decode_num_accepted_tokens", "Draft tokens accepted"),
    "lora_slot_loads_total": ("lora_slot_loads", "LoRA adapters copied from host memory into a device slot"),
    "lora_slot_evictions_total": ("lora_slot_evictions", "Resident LoRA adapters evicted for another (least "
                                                         "recently used first)"),
}


class _SchedulerStats:
    """A collector yielding the scheduler's stats of the current scrape."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: dict = {}

    def collect(self):
        labels = [self.model_name]
        s = self.stats
        for key, (name, doc) in _STAT_GAUGES.items():
            if isinstance(s.get(key), (int, float)):
                g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
                g.add_metric(labels, s[key])
                yield g
        total, used = s.get("kv_total_tokens"), s.get("kv_used_tokens")
        if isinstance(total, (int, float)) and isinstance(used, (int, float)) and total > 0:
            g = GaugeMetricFamily(PREFIX + "gpu_cache_usage_perc",
                                  "Fraction of the KV cache held by live requests (1 = full; the CPU pool on CPU)",
                                  labels=["model_name"])
            g.add_metric(labels, used / total)
            yield g
        for key, (name, doc) in _STAT_COUNTERS.items():
            if isinstance(s.get(key), (int, float)):
                c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
                c.add_metric(labels, s[key])
                yield c


class ServerMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._scheduler = _SchedulerStats(model_name)
        self.registry.register(self._scheduler)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first output token "
                              "(streamed or not)", _TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Time per output token after the first "
                              "(one observation per token)", _TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last output token",
                             _REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time a request waited before its first "
                                    "prefill (grammar compiles included)", _REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request", _TOKEN_BUCKETS)
        self.generation_tokens = histogram("request_generation_tokens", "Generated tokens per choice", _TOKEN_BUCKETS)
        self.params_n = histogram("request_params_n", "The n of each request (choices returned)", _N_BUCKETS)
        self.params_best_of = histogram("request_params_best_of", "The best_of of each request (choices sampled)",
                                        _N_BUCKETS)
        success = Counter(PREFIX + "request_success", "Finished choices by finish reason",
                          ["model_name", "finished_reason"], registry=self.registry)
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.requests_aborted = counter("requests_aborted", "Requests aborted (client gone, abort_request, shutdown)")
        self.http_errors = counter("http_errors", "Requests answered with an error status")
        info = Gauge(PREFIX + "model_info", "Served model", ["model_name"], registry=self.registry)
        info.labels(model_name).set(1)

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_tokens(self, seconds: float, num_tokens: int) -> None:
        """`num_tokens` output tokens (after the first) that took `seconds` together."""
        if num_tokens <= 0:
            return
        per_token = seconds / num_tokens
        for _ in range(num_tokens):
            self.tpot.observe(per_token)

    def observe_choice(self, prompt_tokens: int, completion_tokens: int, finish_type: Optional[str]) -> None:
        self.generation_tokens.observe(completion_tokens)
        self.success[finish_type if finish_type in ("stop", "length") else "abort"].inc()

    def observe_request(self, e2e_seconds: float, prompt_tokens: int, queue_seconds: Optional[float], n: int,
                        best_of: int) -> None:
        self.e2e.observe(e2e_seconds)
        self.prompt_tokens.observe(prompt_tokens)
        if queue_seconds is not None:
            self.queue_time.observe(max(queue_seconds, 0.0))
        self.params_n.observe(n)
        self.params_best_of.observe(best_of)

    def render(self, stats: Optional[dict]) -> bytes:
        self._scheduler.stats = stats or {}
        return generate_latest(self.registry)
