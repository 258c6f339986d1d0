"""Bounded retries of requests a server shed (HTTP 429 Too Many Requests, 503 Service Unavailable).

Only those two statuses are retried: they say the request itself was fine and may succeed later. The wait
before retry n (from 0) is the response's `Retry-After` (delay-seconds, or an HTTP date) when it has one, else
`initial_backoff_s * 2**n` (at most `max_backoff_s`) with jitter; either way at most `max_sleep_s`.
"""

from __future__ import annotations

import datetime
import email.utils
import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429, 503})
DEFAULT_MAX_RETRIES = 6


@dataclass(frozen=True)
class RetryPolicy:
    """max_retries: retries after the first attempt (so at most max_retries + 1 requests), as the openai client's
    argument of that name."""

    max_retries: int = DEFAULT_MAX_RETRIES
    initial_backoff_s: float = 0.25
    max_backoff_s: float = 8.0
    max_sleep_s: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries must be a non-negative integer, got {self.max_retries!r}")
        for name in ("initial_backoff_s", "max_backoff_s", "max_sleep_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")

    def retry_delay(self, status: int, retry_after: Optional[str], retries_done: int, what: str,
                    reason: str) -> Optional[float]:
        """Seconds to wait before retrying a request (`what`, for the log) that got `status` after `retries_done`
        retries; None when it is not to be retried. Each retry is logged at INFO with the server's `reason`."""
        if status not in RETRY_STATUSES or retries_done >= self.max_retries:
            return None
        delay = parse_retry_after(retry_after)
        source = "Retry-After"
        if delay is None:
            backoff = min(self.initial_backoff_s * 2.0 ** retries_done, self.max_backoff_s)
            # jitter, so that the many requests a server shed at once do not all come back at once
            delay, source = backoff * (0.5 + 0.5 * random.random()), "backoff"
        delay = min(delay, self.max_sleep_s)
        logger.info("%s: HTTP %d (%s); retry %d of %d in %.2f s (%s)", what, status, reason, retries_done + 1,
                    self.max_retries, delay, source)
        return delay


def parse_retry_after(value: Optional[str]) -> Optional[float]:
    """A Retry-After header's wait in seconds (never negative), or None when absent or unreadable. Takes
    delay-seconds (fractions too) or an HTTP date."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # written with zone "-0000": HTTP dates are GMT
            when = when.replace(tzinfo=datetime.timezone.utc)
        seconds = when.timestamp() - time.time()
    if not math.isfinite(seconds):
        return None
    return max(seconds, 0.0)
