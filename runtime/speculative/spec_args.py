"""The speculative-decoding switches of ServerArgs: SGLang's flags, vLLM's `--speculative-config` JSON mapped onto
them, defaults, and the combinations refused (torch-free: ServerArgs.__post_init__ calls `resolve`)."""

from __future__ import annotations

import json

ALGORITHMS = ("NGRAM", "EAGLE", "EAGLE3")
# vLLM's `method` values braid has an algorithm for
VLLM_METHODS = {"ngram": "NGRAM", "eagle": "EAGLE", "eagle3": "EAGLE3"}
# vLLM `speculative_config` keys -> the ServerArgs field each sets (num_speculative_tokens is mapped by algorithm)
VLLM_KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max",
             "disable_by_batch_size")

# NGRAM: tokens verified per request per pass, counting the request's last token (so 4 draft tokens)
DEFAULT_NGRAM_NUM_DRAFT_TOKENS = 5
DEFAULT_NGRAM_MIN_MATCH = 2
DEFAULT_NGRAM_MAX_MATCH = 8
MAX_NUM_DRAFT_TOKENS = 64

FIELDS = ("speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
          "speculative_num_draft_tokens", "speculative_ngram_min_match_window_size",
          "speculative_ngram_max_match_window_size", "speculative_disable_by_batch_size")


def resolve(values: dict) -> dict:
    """values: the speculative fields of ServerArgs as given (FIELDS plus speculative_config) -> FIELDS resolved
    (defaults filled in, the vLLM JSON mapped). Raises ValueError naming the flag for any combination braid would
    otherwise ignore or cannot run."""
    out = {name: values.get(name) for name in FIELDS}
    if values.get("speculative_config") is not None:
        _apply_vllm_config(out, values["speculative_config"])
    algo = out["speculative_algorithm"]
    if algo is None:
        given = [_flag(name) for name in FIELDS[1:] if out[name] is not None]
        if given:
            raise ValueError(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect without "
                             f"--speculative-algorithm ({', '.join(ALGORITHMS)})")
        return out
    algo = algo.upper()
    if algo not in ALGORITHMS:
        raise ValueError(f"speculative_algorithm {out['speculative_algorithm']!r} is not one of "
                         f"{', '.join(ALGORITHMS)}")
    out["speculative_algorithm"] = algo
    for name in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
                 "speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size",
                 "speculative_disable_by_batch_size"):
        if out[name] is not None and out[name] < 1:
            raise ValueError(f"{_flag(name)} must be >= 1")
    if out["speculative_num_draft_tokens"] is not None and not \
            2 <= out["speculative_num_draft_tokens"] <= MAX_NUM_DRAFT_TOKENS:
        raise ValueError(f"--speculative-num-draft-tokens counts the tokens one verify pass takes per request, the "
                         f"request's last token included: between 2 and {MAX_NUM_DRAFT_TOKENS}")
    if algo == "NGRAM":
        _resolve_ngram(out)
    else:
        _resolve_eagle(out, algo)
    return out


def _resolve_ngram(out: dict) -> None:
    if out["speculative_draft_model_path"] is not None:
        raise ValueError("--speculative-draft-model-path names a draft model; NGRAM drafts from the request's own "
                         "tokens and takes none")
    if out["speculative_eagle_topk"] not in (None, 1):
        raise ValueError("--speculative-eagle-topk > 1 (tree drafts) is not supported with NGRAM: its drafts are "
                         "chains (EAGLE and EAGLE3 draft trees)")
    steps, tokens = out["speculative_num_steps"], out["speculative_num_draft_tokens"]
    if steps is not None and tokens is not None and tokens != steps + 1:
        raise ValueError(f"NGRAM drafts a chain: --speculative-num-draft-tokens ({tokens}) must be "
                         f"--speculative-num-steps + 1 ({steps + 1}), or give only one of them")
    tokens = tokens or (steps + 1 if steps is not None else DEFAULT_NGRAM_NUM_DRAFT_TOKENS)
    if tokens > MAX_NUM_DRAFT_TOKENS:
        raise ValueError(f"--speculative-num-steps must be below {MAX_NUM_DRAFT_TOKENS}")
    out.update(speculative_num_draft_tokens=tokens, speculative_num_steps=tokens - 1, speculative_eagle_topk=1)
    lo = out["speculative_ngram_min_match_window_size"] or min(
        DEFAULT_NGRAM_MIN_MATCH, out["speculative_ngram_max_match_window_size"] or DEFAULT_NGRAM_MIN_MATCH)
    hi = out["speculative_ngram_max_match_window_size"] or max(DEFAULT_NGRAM_MAX_MATCH, lo)
    if lo > hi:
        raise ValueError(f"--speculative-ngram-min-match-window-size ({lo}) is above "
                         f"--speculative-ngram-max-match-window-size ({hi})")
    out.update(speculative_ngram_min_match_window_size=lo, speculative_ngram_max_match_window_size=hi)


def _resolve_eagle(out: dict, algo: str) -> None:
    if out["speculative_disable_by_batch_size"] is not None:
        raise ValueError(f"--speculative-disable-by-batch-size is not supported with {algo} yet (its draft head "
                         "reads the target's features at every step, so it cannot sit out steps); NGRAM takes it")
    if out["speculative_draft_model_path"] is None:
        raise ValueError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path (the draft head's "
                         "folder: config.json and its weights)")
    for name in ("speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size"):
        if out[name] is not None:
            raise ValueError(f"{_flag(name)} sets the NGRAM proposer; it has no effect with {algo}")
    topk = out["speculative_eagle_topk"] or 1
    steps = out["speculative_num_steps"] or (out["speculative_num_draft_tokens"] - 1
                                             if out["speculative_num_draft_tokens"] and topk == 1 else 3)
    tokens = out["speculative_num_draft_tokens"] or (steps + 1 if topk == 1 else min(topk * steps + 1, 8))
    if topk == 1 and tokens != steps + 1:
        raise ValueError(f"with --speculative-eagle-topk 1 the draft is a chain: --speculative-num-draft-tokens "
                         f"({tokens}) must be --speculative-num-steps + 1 ({steps + 1})")
    # a tree of depth `steps`: depth 1 has topk candidates, each deeper one topk * topk (the topk best nodes of the
    # depth before, expanded topk ways); the draft is the best tokens - 1 of them (runtime/speculative/draft_tree.py)
    most = topk + (steps - 1) * topk * topk + 1
    if tokens > most:
        raise ValueError(f"--speculative-num-draft-tokens ({tokens}) is more than a tree of depth "
                         f"--speculative-num-steps ({steps}) and width --speculative-eagle-topk ({topk}) holds "
                         f"({most}, the request's last token included)")
    if tokens > MAX_NUM_DRAFT_TOKENS:
        raise ValueError(f"--speculative-num-steps must be below {MAX_NUM_DRAFT_TOKENS}")
    out.update(speculative_num_steps=steps, speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens)


def _apply_vllm_config(out: dict, text: str) -> None:
    """vLLM's --speculative-config '{"method": ..., "num_speculative_tokens": ...}' onto the SGLang-named fields; a
    key also given as a flag must agree with it."""
    try:
        cfg = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError("--speculative-config must be a JSON object such as "
                         "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'")
    unknown = sorted(set(cfg) - set(VLLM_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config: braid does not take {', '.join(unknown)} (it takes "
                         f"{', '.join(VLLM_KEYS)})")
    method = cfg.get("method")
    if method not in VLLM_METHODS:
        raise ValueError(f"--speculative-config: method {method!r} is not one braid runs "
                         f"({', '.join(VLLM_METHODS)})")
    algo = VLLM_METHODS[method]
    mapped = {"speculative_algorithm": algo, "speculative_draft_model_path": cfg.get("model"),
              "speculative_ngram_min_match_window_size": cfg.get("prompt_lookup_min"),
              "speculative_ngram_max_match_window_size": cfg.get("prompt_lookup_max"),
              "speculative_disable_by_batch_size": cfg.get("disable_by_batch_size")}
    n = cfg.get("num_speculative_tokens")
    if n is not None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError("--speculative-config: num_speculative_tokens must be an integer >= 1")
        mapped["speculative_num_draft_tokens"] = n + 1
        if algo != "NGRAM":
            mapped["speculative_num_steps"] = n
    for name, value in mapped.items():
        if value is None:
            continue
        given = out[name]
        if given is not None and (given.upper() if name == "speculative_algorithm" else given) != value:
            raise ValueError(f"--speculative-config sets {_flag(name)} to {value!r}, but the flag gives {given!r}; "
                             "give it once")
        out[name] = value


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")

