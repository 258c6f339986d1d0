"""NGRAM proposer: prompt lookup. The request's last n tokens (n from the longest window down to the shortest) are
looked up earlier in its own prompt and output; the tokens that followed the latest earlier occurrence are the
draft. One numpy scan of the request's tokens per window size and step (an index kept across steps is left for
long contexts)."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, min_match: int, max_match: int, max_draft: int):
        if not 1 <= min_match <= max_match or max_draft < 1:
            raise ValueError("NgramProposer needs 1 <= min_match <= max_match and max_draft >= 1")
        self.min_match = min_match
        self.max_match = max_match
        self.max_draft = max_draft

    def propose(self, tokens: list[int], max_draft: int) -> list[int]:
        """Up to min(max_draft, self.max_draft) tokens predicted to follow `tokens` (the request's prompt + output,
        its last token included); [] when no suffix of min_match..max_match tokens occurred before."""
        k = min(max_draft, self.max_draft)
        L = len(tokens)
        if k < 1 or L < self.min_match + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_match, L - 1), self.min_match - 1, -1):
            pattern = arr[L - n:]
            # windows [i, i + n) over tokens[:L - 1], so that a match has at least one token after it that is
            # not part of the suffix itself: starts 0 .. L - 1 - n
            windows = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                # the latest occurrence followed by a whole draft (the freshest context for a copy), else the latest
                full = hits[hits + n + k <= L]
                start = int(full[-1] if full.size else hits[-1]) + n
                return arr[start:start + k].tolist()
        return []
