"""Periodic serving statistics at INFO, in the spirit of SGLang's batch logs.

One line at most every `ServerArgs.log_stats_interval_s` seconds while the scheduler has work, e.g.

    stats: #running-req: 4, #queue-req: 2, prefill: 812.3 tok/s, decode: 96.1 tok/s, KV usage: 3.2% (1047/32768 tokens), cache hit rate: 41.0%

Throughputs are over the time since the previous line; the cache hit rate is since start-up.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

logger = logging.getLogger("braid.stats")


class ServingStatsLog:
    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self.clock = clock
        self._last_time: Optional[float] = None
        self._last_prefill_tokens = 0
        self._last_decode_tokens = 0

    def maybe_log(self, scheduler) -> Optional[str]:
        """Call once per scheduler iteration; returns the line when it logged one. Cheap when not due."""
        if self.interval_s <= 0:
            return None
        now = self.clock()
        if self._last_time is None:
            self._remember(now, scheduler.get_stats())
            return None
        if now - self._last_time < self.interval_s:
            return None
        stats = scheduler.get_stats()
        prefill_tokens = stats["num_computed_prompt_tokens_total"] - self._last_prefill_tokens
        decode_tokens = stats["num_generated_tokens_total"] - self._last_decode_tokens
        busy = stats["num_running_reqs"] or stats["num_waiting_reqs"]
        if not busy and not prefill_tokens and not decode_tokens:
            self._remember(now, stats)  # idle: the next line's rates start from here
            return None
        line = format_stats_line(stats, prefill_tokens, decode_tokens, now - self._last_time)
        self._remember(now, stats)
        logger.info("%s", line)
        return line

    def _remember(self, now: float, stats: dict) -> None:
        self._last_time = now
        self._last_prefill_tokens = stats["num_computed_prompt_tokens_total"]
        self._last_decode_tokens = stats["num_generated_tokens_total"]


def format_stats_line(stats: dict, prefill_tokens: int, decode_tokens: int, seconds: float) -> str:
    kv_total = stats["kv_total_tokens"] or 1
    return (f"stats: #running-req: {stats['num_running_reqs']}, #queue-req: {stats['num_waiting_reqs']}, "
            f"prefill: {prefill_tokens / seconds:.1f} tok/s, decode: {decode_tokens / seconds:.1f} tok/s, "
            f"KV usage: {100 * stats['kv_used_tokens'] / kv_total:.1f}% "
            f"({stats['kv_used_tokens']}/{stats['kv_total_tokens']} tokens), "
            f"cache hit rate: {100 * stats['cache_hit_rate']:.1f}%")
