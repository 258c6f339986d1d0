"""Prometheus metrics in the text exposition format (version 0.0.4), written by hand.

Latency histograms and token counters are measured in the server process; gauges come from the
scheduler's `get_stats()` at scrape time.
"""

from __future__ import annotations

import bisect
import math
import threading
from typing import Iterable, Optional

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "braid_"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

# scheduler stats exported as gauges: stats key -> help
_STAT_GAUGES = {
    "num_running_reqs": "Requests being decoded or prefilled",
    "num_waiting_reqs": "Requests waiting to be scheduled",
    "kv_used_tokens": "KV cache slots held by live requests",
    "kv_total_tokens": "KV cache size in tokens",
    "kv_free_tokens": "KV cache slots free (including evictable prefix cache)",
    "cache_hit_rate": "Fraction of prompt tokens served from the radix cache",
}
# cumulative scheduler totals exported as counters: stats key -> (metric name, help)
_STAT_COUNTERS = {
    "num_prompt_tokens_total": ("prompt_tokens_total", "Prompt tokens received"),
    "num_generated_tokens_total": ("generation_tokens_total", "Tokens generated"),
    "num_cached_tokens_total": ("cached_prompt_tokens_total", "Prompt tokens served from the radix cache"),
    "num_computed_prompt_tokens_total": ("computed_prompt_tokens_total", "Prompt tokens run through the model"),
}


def _fmt(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))


class Histogram:
    def __init__(self, name: str, help: str, buckets: Iterable[float]):
        self.name, self.help = PREFIX + name, help
        self.bounds = sorted(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # last: +Inf
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.bounds, value)] += 1
            self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        with self._lock:
            cumulative = 0
            for bound, c in zip(self.bounds + [math.inf], self.counts):
                cumulative += c
                lines.append(f'{self.name}_bucket{{le="{_fmt(bound)}"}} {cumulative}')
            lines.append(f"{self.name}_sum {_fmt(self.sum)}")
            lines.append(f"{self.name}_count {cumulative}")
        return lines


class Counter:
    def __init__(self, name: str, help: str):
        self.name, self.help = PREFIX + name, help
        self.value = 0.0

    def inc(self, by: float = 1.0) -> None:
        self.value += by

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter", f"{self.name} {_fmt(self.value)}"]


class ServerMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.ttft = Histogram("time_to_first_token_seconds", "Time from arrival to the first output token", _TTFT_BUCKETS)
        self.itl = Histogram("inter_token_latency_seconds", "Time between output tokens of one request", _ITL_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "Time from arrival to the last output token", _E2E_BUCKETS)
        self.requests_finished = Counter("requests_finished_total", "Requests that finished (any reason)")
        self.requests_aborted = Counter("requests_aborted_total", "Requests aborted (client gone, abort_request, shutdown)")
        self.http_errors = Counter("http_errors_total", "Requests answered with an error status")

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_tokens(self, seconds_since_last: float, num_tokens: int) -> None:
        """One chunk of `num_tokens` arrived `seconds_since_last` after the previous one."""
        if num_tokens <= 0:
            return
        per_token = seconds_since_last / num_tokens
        for _ in range(num_tokens):
            self.itl.observe(per_token)

    def observe_finished(self, e2e_seconds: float, aborted: bool) -> None:
        self.e2e.observe(e2e_seconds)
        self.requests_finished.inc()
        if aborted:
            self.requests_aborted.inc()

    def render(self, stats: Optional[dict]) -> str:
        lines: list[str] = []
        stats = stats or {}
        for key, help in _STAT_GAUGES.items():
            if isinstance(stats.get(key), (int, float)):
                name = PREFIX + key
                lines += [f"# HELP {name} {help}", f"# TYPE {name} gauge", f"{name} {_fmt(stats[key])}"]
        total, used = stats.get("kv_total_tokens"), stats.get("kv_used_tokens")
        if isinstance(total, (int, float)) and isinstance(used, (int, float)) and total > 0:
            name = PREFIX + "kv_usage_ratio"
            lines += [f"# HELP {name} Fraction of the KV cache held by live requests", f"# TYPE {name} gauge",
                      f"{name} {_fmt(used / total)}"]
        for key, (metric, help) in _STAT_COUNTERS.items():
            if isinstance(stats.get(key), (int, float)):
                name = PREFIX + metric
                lines += [f"# HELP {name} {help}", f"# TYPE {name} counter", f"{name} {_fmt(stats[key])}"]
        for metric in (self.ttft, self.itl, self.e2e, self.requests_finished, self.requests_aborted, self.http_errors):
            lines += metric.render()
        name = PREFIX + "model_info"
        lines += [f"# HELP {name} Served model", f"# TYPE {name} gauge",
                  f'{name}{{model="{_escape(self.model_name)}"}} 1']
        return "\n".join(lines) + "\n"


def _escape(label: str) -> str:
    return label.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
