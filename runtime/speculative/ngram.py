"""NGRAM proposer: prompt lookup. The request's last n tokens (n from the longest window down to the shortest) are
looked up earlier in its own prompt and output; the tokens that followed the latest earlier occurrence are the
draft. Per step: one numpy pass over the request's tokens for the positions holding its last token, one over those
candidates for the token before it, and one over the candidates left for every longer match at once (an index kept
across steps is left for very long contexts). The request's tokens reach it as a numpy array: `TokenMirror` keeps
one a request, extended by the tokens appended since the last step, so a step does not convert the whole context
again."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, min_match: int, max_match: int, max_draft: int):
        if not 1 <= min_match <= max_match or max_draft < 1:
            raise ValueError("NgramProposer needs 1 <= min_match <= max_match and max_draft >= 1")
        self.min_match = min_match
        self.max_match = max_match
        self.max_draft = max_draft

    def propose(self, tokens, max_draft: int) -> list[int]:
        """Up to min(max_draft, self.max_draft) tokens predicted to follow `tokens` (the request's prompt + output,
        its last token included: a list of ints or an int64 numpy array); [] when no suffix of min_match..max_match
        tokens occurred before."""
        k = min(max_draft, self.max_draft)
        L = len(tokens)
        if k < 1 or L < self.min_match + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        # candidates: earlier positions i holding the last token (an occurrence of the suffix ends there, with at
        # least one token after it)
        ends = np.flatnonzero(arr[:L - 1] == arr[L - 1])
        if ends.size == 0:
            return []
        limit = min(self.max_match, L - 1)  # suffix tokens a match may count
        best, hits = 1, ends
        if limit > 1:
            # the candidates whose token before matches too (most drop out here), then the runs of those, every
            # length at once (a run lasts while the tokens before the candidate and before the last token agree)
            two = ends[(ends >= 1) & (arr[np.maximum(ends - 1, 0)] == arr[L - 2])]
            if two.size:
                back = np.arange(2, limit)
                before = two[:, None] - back
                same = (arr[np.maximum(before, 0)] == arr[L - 1 - back]) & (before >= 0)
                matched = 2 + np.logical_and.accumulate(same, axis=1).sum(axis=1)
                best = int(matched.max())
                hits = two[matched == best]
        if best < self.min_match:
            return []
        full = hits[hits + 1 + k <= L]
        start = int(full[-1] if full.size else hits[-1]) + 1
        return arr[start:start + k].tolist()


class TokenMirror:
    """A request's fill_ids as an int64 numpy array, kept across steps. The scheduler only ever appends to a
    request's fill_ids list in place (a rewrite, such as jump-forward's, makes a new list), so while the list is the
    same object the mirror copies only the tokens appended since; another list, a shorter one or a last mirrored
    token that differs rebuilds it."""

    __slots__ = ("source", "buffer", "length")

    def __init__(self):
        self.source, self.buffer, self.length = None, np.empty(0, dtype=np.int64), 0

    def view(self, tokens: list[int]) -> np.ndarray:
        """tokens (the request's fill_ids) -> an int64 array equal to it (a view of the mirror's buffer, valid
        until the next call)."""
        n, have = len(tokens), self.length
        if (tokens is not self.source or n < have
                or (have and self.buffer[have - 1] != tokens[have - 1])):
            self.source, have = tokens, 0
        if n > self.buffer.shape[0]:
            grown = np.empty(max(n + 64, 2 * self.buffer.shape[0]), dtype=np.int64)
            grown[:have] = self.buffer[:have]
            self.buffer = grown
        if n > have:
            self.buffer[have:n] = tokens[have:n]
        self.length = n
        return self.buffer[:n]
