"""The verification cost of speculative decoding at a set acceptance length, on a Llama-3-8B-shaped dummy bf16 model
in braid's Engine at its defaults (CUDA graphs for the plain decode steps and the verify passes), against the
non-speculative engine, in one process.

Random weights draft nothing a target would accept, so a benchmark-only proposer replays the target's own greedy
tokens. Random weights also leave near-ties among the greedy token's rivals, which a verify pass's kernels (other than
a decode step's) break the other way in bf16; so every engine's dummy model is made decisive after loading
(make_decisive: the attention and MLP output projections zeroed, so the residual stream is the token's embedding,
and the LM head's rows a fixed permutation of the embedding's, so the greedy successor of token t is the one row
whose weights are t's embedding, by a margin far above rounding). Every kernel still runs at its shapes on the same
bytes, so the cost is the random model's. Then: the non-speculative engine first records every request's greedy output, then the speculative engine's
proposer offers, at each step, the next k recorded tokens of each request, the first A - 1 as recorded and the rest
changed to another id. Greedy verification then accepts A - 1 drafts a pass and emits A tokens a pass (those drafts
and the target's own token): the mean acceptance length is A, as the decoder's stats() measure it.

- NGRAM: `--speculative-algorithm NGRAM` (k = --speculative-num-draft-tokens - 1); the decoder's NgramProposer still
  runs its lookup on every request (its host cost is paid), and its draft is replaced by the replay's.
- EAGLE: `--speculative-algorithm EAGLE` with a random one-layer EAGLE head of the target's shapes, written in the
  published layout (fc over [embedding, hidden], `layers.0.*` without an input norm); the head runs its catch-up and
  its k chain steps as it would, then its draft is replaced by the replay's (k = --speculative-num-steps).
- NGRAM with --speculative-disable-by-batch-size below the batch: the speculative engine's plain decode steps.

Batch 1 at acceptance lengths --accept-lens, and --large-batch requests at once at --large-batch-accept-len. Each
run starts from an empty prefix cache; decode tok/s = batch * (output_len - 1) / (time of output_len tokens, the
fastest of --repeats runs, - time of 1 token, the prefill). The non-speculative engine is warmed up by one untimed
run of each batch. A verify pass's logits come from other kernels than a decode step's, so in bf16 a near-tie can turn a
greedy token; the replay would then offer drafts the target refuses. So before each timed run the replay's record
is run untimed until the speculative output equals it (a fixed point; the first of these runs is the warm-up), and
the table says whether the timed output equals the non-speculative greedy output token for token. The card's copy
rate is printed first; the table last, with issue 48's targets beside the rows they apply to.

  python3 benchmarks/gpu/speculative_verify_cost.py --tokenizer-path .gpu/tok [--out results.json]
  (CPU: --model-config TINY.json --device cpu --dtype float32 --output-len 64)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time

from sweep_rows import copy_bandwidth  # benchmarks/gpu, this script's folder

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "llama3-8b.json")
# issue 48's targets: decode tok/s against the non-speculative path at batch 1, A = 3 ...
B1_TARGETS = {"ngram": 2.4, "eagle": 2.0}
B1_TARGET_ACCEPT_LEN = 3
# ... and at batch 32, A = 3 (or speculation off there by --speculative-disable-by-batch-size)
LARGE_BATCH_TARGET = 0.97
# the decoder's counters, and the extend passes (verify passes among them) that replayed a CUDA graph
STAT_KEYS = ("spec_num_verify_forward", "spec_num_drafts_total", "spec_num_accepted_tokens_total",
             "spec_num_steps_disabled_by_batch_size", "num_forward_extend_graphed")


class Replay:
    """The benchmark-only drafts: records[prompt] is the request's output to replay; draft() gives the next k tokens
    of it after `output`, the first accept_len - 1 as recorded, the others changed to another id (so that greedy
    verification refuses them)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.records: dict[tuple, list[int]] = {}
        self.accept_len = 1

    def draft(self, prompt, output, k: int) -> list[int]:
        record = self.records.get(tuple(prompt))
        if record is None or k < 1:
            return []
        ahead = record[len(output):len(output) + k]
        good = self.accept_len - 1
        return [t if i < good else (t + 1) % self.vocab_size for i, t in enumerate(ahead)]


class ReplayNgram:
    """NgramProposer's interface for SpeculativeDecoder: the real proposer's lookup runs, the replay's draft is
    returned. tokens: the request's prompt (prompt_len tokens: every prompt here has that length) + output."""

    def __init__(self, real, replay: Replay, prompt_len: int):
        self.real, self.replay, self.prompt_len = real, replay, prompt_len
        self.min_match, self.max_match, self.max_draft = real.min_match, real.max_match, real.max_draft

    def propose(self, tokens: list[int], max_draft: int) -> list[int]:
        self.real.propose(tokens, max_draft)
        P = self.prompt_len
        return self.replay.draft(tokens[:P], tokens[P:], min(max_draft, self.max_draft))


def install_replay(engine, replay: Replay, prompt_len: int) -> int:
    """Put the replay into the engine's SpeculativeDecoder -> the draft tokens a request a pass (k)."""
    decoder = engine.scheduler.spec
    if decoder.eagle is None:
        decoder.proposer = ReplayNgram(decoder.proposer, replay, prompt_len)
        return decoder.max_draft
    eagle = decoder.eagle
    head_propose = eagle.propose

    def propose(reqs, rooms):
        drafts = head_propose(reqs, rooms)  # the head's catch-up and chain steps run; their tokens are replaced
        return [replay.draft(r.input_ids, r.output_ids, len(d)) if d else [] for r, d in zip(reqs, drafts)]

    eagle.propose = propose
    return eagle.num_steps


def write_eagle_head(folder: str, config: dict, device: str) -> str:
    """A random one-layer EAGLE head for the target of `config` in the published layout -> its folder. Weights
    uniform in +-0.02 as the dummy target's (norms 1); drawn on `device`, saved in bf16."""
    import torch
    from safetensors.torch import save_file

    H, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    hd = config.get("head_dim") or H // heads
    gen = torch.Generator(device=device).manual_seed(1)
    shapes = {"fc.weight": (H, 2 * H), "fc.bias": (H,),
              "layers.0.self_attn.q_proj.weight": (heads * hd, H),
              "layers.0.self_attn.k_proj.weight": (kv_heads * hd, H),
              "layers.0.self_attn.v_proj.weight": (kv_heads * hd, H),
              "layers.0.self_attn.o_proj.weight": (H, heads * hd),
              "layers.0.mlp.gate_proj.weight": (inter, H), "layers.0.mlp.up_proj.weight": (inter, H),
              "layers.0.mlp.down_proj.weight": (H, inter)}
    tensors = {name: torch.empty(shape, device=device).uniform_(-0.02, 0.02, generator=gen).bfloat16().cpu()
               for name, shape in shapes.items()}
    tensors["layers.0.post_attention_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    os.makedirs(folder, exist_ok=True)
    head_config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=H,
                       intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=hd, num_hidden_layers=1, vocab_size=config["vocab_size"],
                       rms_norm_eps=config.get("rms_norm_eps", 1e-5), rope_theta=config.get("rope_theta", 10000.0),
                       rope_scaling=config.get("rope_scaling"),
                       max_position_embeddings=config.get("max_position_embeddings", 4096), torch_dtype="bfloat16")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(head_config, f)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    return folder


def make_decisive(engine, seed: int = 3) -> None:
    """Zero every layer's o_proj and down_proj, and set LM head row j to embedding row perm[j] (a seeded permutation,
    the same for every engine): logits_j = <e_perm[j], norm(e_t)>, largest where perm[j] = t."""
    import torch

    model = engine.scheduler.runner.model
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    if head.data_ptr() == embed.data_ptr():
        raise ValueError("make_decisive needs an untied LM head (tie_word_embeddings false)")
    rows = embed.shape[0]
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed)).to(embed.device)
    with torch.no_grad():
        head[:rows].copy_(embed[perm])
        changed = [model.lm_head]
        for layer in model.model.layers:
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                proj.weight.zero_()
                changed.append(proj)
        for module in changed:  # a prepacked copy (CPU) is rebuilt from the changed weight
            module.linear_method.process_weights_after_loading(module)


def make_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab_size, 30000), (count, length), generator=gen).tolist()


def run(engine, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    """All prompts at once from an empty prefix cache, greedy, output_len tokens each -> (seconds, output ids)."""
    if not engine.flush_cache():
        raise RuntimeError("the engine did not flush its prefix cache (requests still running)")
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    start = time.perf_counter()
    out = engine.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    ids = [r["output_ids"] for r in out]
    assert all(len(x) == output_len for x in ids), [len(x) for x in ids]
    return elapsed, ids


def timed_runs(engine, prompts, output_len: int, repeats: int) -> tuple[float, list[list[list[int]]]]:
    """-> (the fastest run's seconds, every run's output ids)."""
    runs = [run(engine, prompts, output_len) for _ in range(repeats)]
    return min(s for s, _ in runs), [out for _, out in runs]


def equal(outs: list[list[int]], others: list[list[int]]) -> int:
    return sum(a == b for a, b in zip(outs, others))


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def spec_stats(engine) -> dict:
    s = engine.get_stats()
    return {k: s.get(k, 0) for k in STAT_KEYS}


def measure_spec(engine, replay: Replay, prompts, greedy: list[list[int]], accept_len: int, output_len: int,
                 first_token_s: float, rounds: int, repeats: int) -> dict:
    """The timed speculative runs of `prompts` at acceptance length accept_len (the fastest counts; the decoder's
    counters over all of them), after the untimed runs that make the replay's record a fixed point (at most
    `rounds`). equal_*: requests whose output equals the non-speculative greedy output / the record, in every timed
    run."""
    replay.accept_len = accept_len
    replay.records = {tuple(p): list(g) for p, g in zip(prompts, greedy)}
    first_equal = None
    for done in range(1, rounds + 1):
        _, out = run(engine, prompts, output_len)
        if first_equal is None:
            first_equal = equal(out, greedy)
        moved = [first_difference(o, replay.records[tuple(p)]) for p, o in zip(prompts, out)
                 if o != replay.records[tuple(p)]]
        if not moved:
            break
        print(f"  A={accept_len} batch {len(prompts)}: {len(moved)} output(s) left the record (first at token "
              f"{min(moved)}); replaying this run's output", flush=True)
        replay.records = {tuple(p): list(o) for p, o in zip(prompts, out)}
    before = spec_stats(engine)
    seconds, outs = timed_runs(engine, prompts, output_len, repeats)
    after = spec_stats(engine)
    delta = {k: after[k] - before[k] for k in STAT_KEYS}
    drafts = delta["spec_num_drafts_total"]
    batch = len(prompts)
    return dict(batch=batch, accept_len=accept_len,
                accept_len_measured=1 + delta["spec_num_accepted_tokens_total"] / drafts if drafts else None,
                tok_s=batch * (output_len - 1) / (seconds - first_token_s), seconds=seconds, rounds=done,
                equal_greedy=min(equal(out, greedy) for out in outs), first_run_equal_greedy=first_equal,
                equal_record=min(equal(out, [replay.records[tuple(p)] for p in prompts]) for out in outs), **delta)


def issue_target(row: dict, large_batch: int):
    """Issue 48's ratio for this row, or None."""
    if row["batch"] == 1 and row["accept_len"] == B1_TARGET_ACCEPT_LEN:
        return B1_TARGETS.get(row["variant"])
    return LARGE_BATCH_TARGET if row["batch"] == large_batch else None


def first_token_seconds(engine, prompts) -> float:
    return min(run(engine, prompts, 1)[0] for _ in range(2))


def print_table(rows: list[dict], large_batch: int, disable_by_batch_size: int) -> None:
    print("| variant | batch | acceptance length set / measured | tok/s | vs non-spec | issue 48 target | "
          "= non-spec greedy |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        batch = row["batch"]
        if row["variant"] == "non-speculative":
            print(f"| non-speculative | {batch} | - | {row['tok_s']:.1f} | 1.000 | | |")
            continue
        name = f"{row['variant']} (k={row['draft_tokens']})"
        if row["variant"] == "ngram-disabled":
            name = f"ngram, disabled above batch {disable_by_batch_size}"
        measured = f"{row['accept_len_measured']:.2f}" if row["accept_len_measured"] else "-"
        if row["spec_num_steps_disabled_by_batch_size"]:
            measured += (f" ({row['spec_num_steps_disabled_by_batch_size']} steps decoded plainly, "
                         f"{row['spec_num_verify_forward']} verified)")
        target = issue_target(row, large_batch)
        target = "" if target is None else f">= {target}x {'met' if row['ratio'] >= target else 'not met'}"
        print(f"| {name} | {batch} | {row['accept_len']} / {measured} | {row['tok_s']:.1f} | {row['ratio']:.3f} | "
              f"{target} | {row['equal_greedy']}/{batch} |")


def save(path, args, rows: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)


def free_device_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer-path", default=".gpu/tok")
    p.add_argument("--model-config", default=CONFIG, help="an HF config.json of the shapes (dummy weights)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--accept-lens", type=int, nargs="+", default=[2, 3, 4], help="batch-1 acceptance lengths")
    p.add_argument("--large-batch", type=int, default=32)
    p.add_argument("--large-batch-accept-len", type=int, default=3)
    p.add_argument("--disable-by-batch-size", type=int, default=16,
                   help="--speculative-disable-by-batch-size of the NGRAM engine whose large batch decodes plainly")
    p.add_argument("--ngram-draft-tokens", type=int, default=None,
                   help="--speculative-num-draft-tokens of the NGRAM engines (default: the runtime's)")
    p.add_argument("--eagle-steps", type=int, default=None,
                   help="--speculative-num-steps of the EAGLE engine (default: the runtime's)")
    p.add_argument("--variants", nargs="+", default=["ngram", "eagle", "ngram-disabled"],
                   choices=["ngram", "eagle", "ngram-disabled"])
    p.add_argument("--rounds", type=int, default=3,
                   help="untimed runs at most before each timed speculative run (the replay's record settling)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each row; the fastest counts")
    p.add_argument("--max-total-tokens", type=int, default=20000)
    p.add_argument("--engine-args", default="{}", help="more Engine (ServerArgs) keywords as JSON, for every engine")
    p.add_argument("--out", default=None, help="a JSON file for the rows")
    args = p.parse_args(argv)
    import torch

    from braid.runtime import Engine

    t0 = time.perf_counter()
    if torch.cuda.is_available() and args.device != "cpu":
        print(f"{torch.cuda.get_device_name()}: copy rate {copy_bandwidth() / 1e12:.2f} TB/s", flush=True)
        free_device_memory()
    with open(args.model_config) as f:
        config = json.load(f)
    vocab = config["vocab_size"]
    common = dict(model_path="llama3-8b-dummy", load_format="dummy", model_config=args.model_config,
                  tokenizer_path=args.tokenizer_path, dtype=args.dtype, device=args.device,
                  max_total_tokens=args.max_total_tokens, log_level="warning", **json.loads(args.engine_args))
    batches = {1: make_prompts(1, args.input_len, vocab, seed=1),
               args.large_batch: make_prompts(args.large_batch, args.input_len, vocab, seed=2)}
    L = args.output_len

    def up(label: str, **extra):
        start = time.perf_counter()
        engine = Engine(**common, **extra)
        make_decisive(engine)
        print(f"{label} engine up in {time.perf_counter() - start:.0f} s", flush=True)
        return engine

    # the non-speculative path: each batch's greedy outputs (the replay's record) and decode tok/s
    greedy, base, rows = {}, {}, []
    with up("non-speculative") as engine:
        for batch, prompts in batches.items():
            _, warm = run(engine, prompts, L)  # warm-up
            first = first_token_seconds(engine, prompts)
            seconds, outs = timed_runs(engine, prompts, L, args.repeats)
            greedy[batch] = outs[0]
            base[batch] = batch * (L - 1) / (seconds - first)
            same = min(equal(out, warm) for out in outs)
            print(f"non-speculative batch {batch}: {base[batch]:.1f} tok/s; greedy outputs equal in all "
                  f"{args.repeats + 1} runs: {same}/{batch}", flush=True)
            rows.append(dict(variant="non-speculative", batch=batch, tok_s=base[batch], seconds=seconds))
            save(args.out, args, rows)
        stats = engine.get_stats()
        print(f"decode passes graphed {stats['num_forward_decode_graphed']} of {stats['num_forward_decode']}",
              flush=True)
    free_device_memory()

    folder = tempfile.mkdtemp(prefix="spec_verify_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        for variant in args.variants:
            replay = Replay(vocab)
            plan = [(1, a) for a in args.accept_lens] + [(args.large_batch, args.large_batch_accept_len)]
            if variant == "eagle":
                head = write_eagle_head(os.path.join(folder, "eagle"), config,
                                        "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
                extra = dict(speculative_algorithm="EAGLE", speculative_draft_model_path=head,
                             speculative_num_steps=args.eagle_steps)
            else:
                extra = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=args.ngram_draft_tokens)
                if variant == "ngram-disabled":
                    extra["speculative_disable_by_batch_size"] = args.disable_by_batch_size
                    plan = plan[-1:]  # the large batch alone
            with up(variant, **extra) as engine:
                k = install_replay(engine, replay, args.input_len)
                firsts = {}  # batch -> seconds of the 1-token run (the prefill) in this engine
                for batch, accept_len in plan:
                    if accept_len > k + 1:
                        print(f"  A={accept_len} needs {accept_len - 1} draft tokens; {variant} drafts {k}: skipped")
                        continue
                    prompts = batches[batch]
                    if batch not in firsts:
                        firsts[batch] = first_token_seconds(engine, prompts)
                    row = measure_spec(engine, replay, prompts, greedy[batch], accept_len, L, firsts[batch],
                                       args.rounds, args.repeats)
                    row.update(variant=variant, draft_tokens=k, ratio=row["tok_s"] / base[batch])
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    save(args.out, args, rows)  # row by row: a run cut short keeps what it measured
            free_device_memory()
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    print(f"\n{args.input_len} in / {L} out, greedy; {os.path.basename(args.model_config)} dummy {args.dtype}; "
          f"{time.perf_counter() - t0:.0f} s in all\n")
    print_table(rows, args.large_batch, args.disable_by_batch_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
