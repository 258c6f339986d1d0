"""Gemma-2 on tiny random configs (window 16 on layers 0 and 2, layer 1 global, soft-caps that bite): braid loads
HF's safetensors and matches HF `Gemma2ForCausalLM` (eager attention, fp32) in greedy tokens and in the logits of
every position it computes (max |Δlogit| <= 1e-3): prefill, decode far past the window, chunked prefill across the
window, a cached prefix longer than the window, mixed-length batches; on the torch backend and on the Triton
backend (under TRITON_INTERPRET=1 on CPU, set by tests/conftest.py; smaller cases there)."""

import os

import pytest
import torch

from braid.runtime import Engine
from byte_tokenizer import byte_tokenizer
from gguf_files import gguf_writer, write_hf_tensors

WINDOW = 16
VOCAB = 512
ATOL = 1e-3
GREEDY = {"temperature": 0, "ignore_eos": True}


def _config(**overrides):
    import transformers

    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=WINDOW,
                  query_pre_attn_scalar=24, attn_logit_softcapping=3.0, final_logit_softcapping=4.0)
    return transformers.Gemma2Config(**{**kwargs, **overrides})


def _save(path, cfg, seed=0):
    """A random model of cfg's class (Gemma2ForCausalLM here, Gemma3ForCausalLM in test_gemma3.py) saved with
    save_pretrained; returned in eager attention for the reference."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # larger weights than HF's init: logits far from uniform, both soft-caps reached
        for name, p in model.named_parameters():
            p.normal_(0, 0.5 if name.endswith("norm.weight") else 0.25)
    model.save_pretrained(path, safe_serialization=True)
    byte_tokenizer().save_pretrained(path)
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma2")
    return str(path), _save(path, _config())


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """Lets the Engine take the Triton backend on CPU, where its kernels run under TRITON_INTERPRET=1."""
    from braid.runtime.model_executor import model_runner

    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"
        monkeypatch.setattr(model_runner, "check_backend_device", lambda name, device: None)


def _engine(path, backend, **kw):
    kw = {"max_total_tokens": 2048, "max_running_requests": 8, "log_level": "warning", **kw}
    return Engine(model_path=path, attention_backend=backend, **kw)


def _prompts(lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


class LogitTrace:
    """The logits braid computes for every row of every forward pass (its LM head, final soft-cap included, applied
    to all rows), with the request slot and position of each row, to be checked against HF's at that position."""

    def __init__(self, engine):
        self.rows = []  # (request slot, position, extend run (first position, tokens) or None, logits [V])
        self.decode_batch_sizes = []
        self._handle = engine.scheduler.runner.model.register_forward_hook(self._hook)

    def _hook(self, module, args, hidden):
        fb = args[0]
        logits = module.lm_head(hidden)[:, :VOCAB].float().cpu()
        ids, pos = fb.input_ids.cpu().tolist(), fb.positions.cpu().tolist()
        slots = fb.req_pool_indices.cpu().tolist()
        if fb.forward_mode.is_decode():
            self.decode_batch_sizes.append(fb.batch_size)
            self.rows += [(slots[i], pos[i], None, logits[i]) for i in range(fb.batch_size)]
            return
        start = 0
        for i, n in enumerate(fb.extend_seq_lens_cpu):
            run = (pos[start], tuple(ids[start:start + n]))
            self.rows += [(slots[i], pos[start + j], run, logits[start + j]) for j in range(n)]
            start += n

    def close(self):
        self._handle.remove()

    def by_sequence(self, sequences):
        """-> per sequence [(position, logits)]: an extend run belongs to the sequence holding its tokens at its
        positions, a decode row to the sequence last extended in the same request slot."""
        owner, out = {}, [[] for _ in sequences]
        for slot, p, run, logits in self.rows:
            if run is not None:
                first, tokens = run
                hits = [k for k, s in enumerate(sequences) if tuple(s[first:first + len(tokens)]) == tokens]
                assert hits, "an extend run matches no request"
                owner[slot] = hits[0]
            out[owner[slot]].append((p, logits))
        return out

    def extend_runs(self):
        return sorted({run for _, _, run, _ in self.rows if run is not None})


def _hf_logits(hf, seq):
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0].float()


def _run(path, backend, prompts, new_tokens, **engine_kw):
    """Prompts submitted together (one batch) -> (results, trace)."""
    with _engine(path, backend, **engine_kw) as engine:
        trace = LogitTrace(engine)
        res = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": new_tokens})
        trace.close()
    return res, trace


def _check(hf, prompts, results, trace, new_tokens):
    """Greedy tokens equal HF generate's (its sliding-window cache) and every logit row braid computed equals HF's
    full forward of the final sequence at that row's position (its eager sliding-window mask)."""
    sequences = [p + r["output_ids"] for p, r in zip(prompts, results)]
    worst = 0.0
    for k, rows in enumerate(trace.by_sequence(sequences)):
        prompt = prompts[k]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        assert results[k]["output_ids"] == ref[0, len(prompt):].tolist(), f"greedy tokens of request {k}"
        positions = {p for p, _ in rows}
        assert set(range(len(prompt) - 1, len(sequences[k]) - 1)) <= positions, "rows missing from the trace"
        want = _hf_logits(hf, sequences[k])
        worst = max([worst] + [(got - want[p]).abs().max().item() for p, got in rows])
    assert worst <= ATOL, f"max |Δlogit| {worst:.2e}"


# ---------------------------------------------------------------------------------------------- torch backend

def test_prefill_only(checkpoint):
    path, hf = checkpoint
    prompts = _prompts([64, 200])
    for prompt in prompts:
        res, trace = _run(path, "torch", [prompt], 1)
        _check(hf, [prompt], res, trace, 1)


@pytest.mark.parametrize("backend,prompt_len,new_tokens", [("torch", 64, 100), ("triton", 24, 20)])
def test_decode_past_the_window(checkpoint, triton_on_cpu, backend, prompt_len, new_tokens):
    path, hf = checkpoint
    prompts = _prompts([prompt_len], seed=2)
    res, trace = _run(path, backend, prompts, new_tokens)
    _check(hf, prompts, res, trace, new_tokens)


@pytest.mark.parametrize("backend,prompt_len", [("torch", 72), ("triton", 40)])
def test_chunked_prefill_across_the_window(checkpoint, triton_on_cpu, backend, prompt_len):
    path, hf = checkpoint
    prompts = _prompts([prompt_len], seed=3)
    res, trace = _run(path, backend, prompts, 4, chunked_prefill_size=8)
    runs = trace.extend_runs()
    assert len(runs) == prompt_len // 8 and all(len(tokens) == 8 for _, tokens in runs)
    _check(hf, prompts, res, trace, 4)


@pytest.mark.parametrize("backend,prefix_len", [("torch", 100), ("triton", 40)])
def test_cached_prefix_longer_than_the_window(checkpoint, triton_on_cpu, backend, prefix_len):
    """A follow-up request extends a finished one (the radix cache holds its window KV at its end) and computes
    only its new tokens; a request branching off inside the cached prefix is right too (hit or recomputed)."""
    path, hf = checkpoint
    prefix, tail_b, tail_c = _prompts([prefix_len, 9, 13], seed=4)
    with _engine(path, backend) as engine:
        first = engine.generate(input_ids=prefix, sampling_params={**GREEDY, "max_new_tokens": 4})
        follow_up = prefix + first["output_ids"] + tail_b
        trace = LogitTrace(engine)
        second = engine.generate(input_ids=follow_up, sampling_params={**GREEDY, "max_new_tokens": 6})
        trace.close()
        branch = prefix[:prefix_len - 5] + tail_c
        branch_trace = LogitTrace(engine)
        third = engine.generate(input_ids=branch, sampling_params={**GREEDY, "max_new_tokens": 6})
        branch_trace.close()
    (start, tokens), = trace.extend_runs()
    assert start >= prefix_len > WINDOW and start + len(tokens) == len(follow_up)
    _check(hf, [follow_up], [second], trace, 6)
    _check(hf, [branch], [third], branch_trace, 6)


@pytest.mark.parametrize("backend,lengths,new_tokens", [("torch", [64, 130, 200, 5], 24), ("triton", [30, 7, 45], 8)])
def test_batch_of_mixed_lengths(checkpoint, triton_on_cpu, backend, lengths, new_tokens):
    path, hf = checkpoint
    prompts = _prompts(lengths, seed=5)
    res, trace = _run(path, backend, prompts, new_tokens)
    assert max(trace.decode_batch_sizes) == len(prompts)
    _check(hf, prompts, res, trace, new_tokens)


# ---------------------------------------------------------------------------------------------- the conventions

def test_window_covers_the_last_w_keys(tmp_path, triton_on_cpu):
    """With one windowed layer, the logits at position p ignore the token at p - W and depend on the one at
    p - W + 1: HF's convention (p - W, p], which braid follows in prefill and in decode, on both backends."""
    hf = _save(tmp_path, _config(num_hidden_layers=1))
    assert hf.config.layer_types == ["sliding_attention"]
    base = _prompts([40], seed=6)[0]
    p = len(base) - 1

    def changed(i):
        seq = list(base)
        seq[i] = (seq[i] + 1) % VOCAB
        return seq

    variants = [base, changed(p - WINDOW), changed(p - WINDOW + 1)]
    hf_last = [_hf_logits(hf, s)[p] for s in variants]
    assert torch.equal(hf_last[0], hf_last[1]) and (hf_last[0] - hf_last[2]).abs().max() > 1e-2
    for backend in ("torch", "triton"):
        # prompts of p tokens: the prefill's last row is at p - 1, the first decode step's query at p; the decode
        # token differs between variants only if the prefill saw the change, so feed each variant HF's token
        res, trace = _run(str(tmp_path), backend, [s[:p] for s in variants], 2)
        rows = [dict(r) for r in trace.by_sequence([s[:p] + r["output_ids"] for s, r in zip(variants, res)])]
        assert (rows[0][p - 1] - rows[1][p - 1]).abs().max() > 1e-2, backend  # p - W is in the window of p - 1
        assert res[0]["output_ids"][0] == res[1]["output_ids"][0]  # the same token at p, and p - W out of its window:
        assert (rows[0][p] - rows[1][p]).abs().max() < 1e-5, backend
        assert (rows[0][p] - rows[2][p]).abs().max() > 1e-2, backend
        for seq, r, row in zip(variants, res, rows):
            want = _hf_logits(hf, seq[:p] + r["output_ids"][:1])
            assert (row[p - 1] - want[p - 1]).abs().max() < ATOL and (row[p] - want[p]).abs().max() < ATOL, backend


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_window_layers_skip_old_keys_not_mask_them(checkpoint, triton_on_cpu, backend):
    """Window layers never read a key older than their window, in extend over a cached prefix and in decode: with
    one KV pool (no trimming) the window layers' K and V of a cached prefix's old positions are set to NaN, and
    the follow-up request's tokens and logits still equal HF's (a masked read would carry NaN through 0 * NaN)."""
    path, hf = checkpoint
    prefix, tail = _prompts([60, 9], seed=8)
    with _engine(path, backend, disable_window_kv_trimming=True) as engine:
        engine.generate(input_ids=prefix, sampling_params={**GREEDY, "max_new_tokens": 1})
        slots, _ = engine.scheduler.prefix_cache.match_prefix(prefix)
        assert len(slots) >= len(prefix) - 1
        old = slots[: len(prefix) - WINDOW].long()  # out of every later query's window
        pool = engine.scheduler.kv_pool
        window_layers = [i for i, spec in enumerate(engine.scheduler.model_config.layers) if spec.sliding_window]
        for layer in window_layers:
            pool.get_key_buffer(layer)[old] = float("nan")
            pool.get_value_buffer(layer)[old] = float("nan")
        follow_up = prefix + tail
        trace = LogitTrace(engine)
        res = engine.generate(input_ids=follow_up, sampling_params={**GREEDY, "max_new_tokens": 12})
        trace.close()
    (start, _), = trace.extend_runs()
    assert start >= len(prefix) - 1  # the prefix came from the cache
    _check(hf, [follow_up], [res], trace, 12)


def test_soft_caps_are_active(tmp_path, checkpoint):
    """Removing either soft-cap changes braid's logits; with them, logits stay inside the final cap and the
    returned logprobs are the log-softmax of the capped logits."""
    path, hf = checkpoint
    prompt = _prompts([48], seed=7)[0]
    res, trace = _run(path, "torch", [prompt], 1)
    capped = torch.stack([logits for _, p, _, logits in trace.rows])
    assert capped.abs().max() < 4.0 and capped.abs().max() > 3.0  # the final cap (4.0) bites
    for name, field in (("attn", "attn_logit_softcapping"), ("final", "final_logit_softcapping")):
        folder = tmp_path / name
        _save(folder, _config(**{field: None}))
        _, uncapped = _run(str(folder), "torch", [prompt], 1)
        diff = (torch.stack([logits for _, _, _, logits in uncapped.rows]) - capped).abs().max()
        assert diff > 0.1, f"{field} had no effect ({diff:.1e})"
    with _engine(path, "torch") as engine:
        out = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 3}, return_logprob=True,
                              logprob_start_len=0, top_logprobs_num=5)
    meta = out["meta_info"]
    logp = torch.log_softmax(_hf_logits(hf, prompt + out["output_ids"]), -1)
    for k, (lp, tok) in enumerate(meta["output_token_logprobs"]):
        assert abs(lp - logp[len(prompt) - 1 + k, tok].item()) < ATOL
    for pos, (lp, tok) in enumerate(meta["input_token_logprobs"][1:], start=1):
        assert abs(lp - logp[pos - 1, tok].item()) < ATOL


def test_embedding_scale_is_rounded_to_the_weight_dtype_like_hf():
    """Gemma multiplies embeddings by sqrt(hidden) rounded to the weight dtype (3584: 59.87 -> 59.75 in bf16)."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2TextScaledWordEmbedding

    from braid.runtime.layers.embedding import VocabEmbedding

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        hf = Gemma2TextScaledWordEmbedding(7, 3584, 0, embed_scale=3584 ** 0.5).to(dtype)
        ours = VocabEmbedding(7, 3584, scale=3584 ** 0.5)
        ours.weight = torch.nn.Parameter(hf.weight.detach().clone(), requires_grad=False)
        ours.build_cache("cpu")
        ids = torch.tensor([0, 3, 6])
        assert torch.equal(ours(ids), hf(ids)), dtype


GEMMA_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
                       "else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                       "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def _add_sentencepiece_tokenizer(writer, vocab_size):
    """A SentencePiece vocabulary of vocab_size pieces in llama.cpp's metadata: Gemma's specials, the 256 byte
    pieces, letters with and without the word marker, then filler words; and Gemma's chat template."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581" + c for c in letters] + letters
    tokens += [f"\u2581w{i}" for i in range(len(tokens), vocab_size)]
    normal = vocab_size - len(specials) - 256
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * (len(specials) + 256) + [-float(i) for i in range(normal)])
    writer.add_token_types([3, 3, 3, 2, 3, 3] + [6] * 256 + [1] * normal)  # control, unknown, byte, normal
    writer.add_bos_token_id(2), writer.add_eos_token_id(1), writer.add_pad_token_id(0), writer.add_unk_token_id(3)
    writer.add_chat_template(GEMMA_CHAT_TEMPLATE)


def _write_gemma2_gguf(path, hf, cfg, with_tokenizer=False):
    """hf's weights as llama.cpp's converter writes a Gemma-2 GGUF (its tensor names, RMSNorm weights stored as
    1 + w, the tied LM head left out), in F32, with the metadata it writes (with_tokenizer: a vocabulary and chat
    template too)."""
    import gguf

    writer = gguf_writer(path, "gemma2", cfg)
    if with_tokenizer:
        _add_sentencepiece_tokenizer(writer, cfg.vocab_size)
    writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_sliding_window(cfg.sliding_window)
    write_hf_tensors(writer, gguf.MODEL_ARCH.GEMMA2, hf, skip=("lm_head.weight",),
                     convert=lambda name, data: data + 1 if name.endswith("norm.weight") else data)


def test_gemma2_gguf_matches_hf(tmp_path):
    """A Gemma-2 GGUF (llama.cpp's layout) loads into braid's model: its tensors equal transformers' GGUF loader's,
    and greedy tokens and every computed logit equal HF's model it was written from, decoding past the window.
    (query_pre_attn_scalar = head_dim here: GGUF has no key for it, see loader/gguf.py.)"""
    import transformers

    from braid.runtime.loader.gguf import gguf_config, iter_gguf_tensors

    cfg = _config(query_pre_attn_scalar=16)
    hf = _save(tmp_path / "hf", cfg, seed=3)
    path = str(tmp_path / "gemma2.gguf")
    _write_gemma2_gguf(path, hf, cfg)

    config = gguf_config(path)
    assert config["model_type"] == "gemma2" and config["sliding_window"] == WINDOW and config["tie_word_embeddings"]
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (3.0, 4.0)
    theirs = transformers.Gemma2ForCausalLM.from_pretrained(str(tmp_path), gguf_file="gemma2.gguf").state_dict()
    ours = dict(iter_gguf_tensors(path, config))
    assert ours.keys() == {k for k in theirs if k != "lm_head.weight"}
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name].float(), rtol=0, atol=0, msg=name)
        torch.testing.assert_close(tensor, hf.state_dict()[name], rtol=0, atol=1e-6, msg=name)

    prompts = _prompts([40], seed=4)
    res, trace = _run(path, "torch", prompts, 30, tokenizer_path=str(tmp_path / "hf"))
    _check(hf, prompts, res, trace, 30)


def test_gemma2_gguf_carries_its_tokenizer_and_chat_template(tmp_path):
    """A Gemma-2 GGUF with its vocabulary and chat template serves on its own (no tokenizer_path): the tokenizer is
    read from the file (through transformers), the chat template renders Gemma's turns, and greedy tokens equal HF's
    model on the same ids."""
    cfg = _config(query_pre_attn_scalar=16)
    hf = _save(tmp_path / "hf", cfg, seed=5)
    path = str(tmp_path / "gemma2-tok.gguf")
    _write_gemma2_gguf(path, hf, cfg, with_tokenizer=True)
    with Engine(model_path=path, attention_backend="torch", max_total_tokens=1024, log_level="warning") as engine:
        tok = engine.tokenizer
        assert type(tok).__name__ == "GemmaTokenizer" and (tok.bos_token, tok.eos_token) == ("<bos>", "<eos>")
        chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
        assert chat == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
        ids = tok.encode("a big cab")
        assert ids[0] == 2 and all(3 < i < VOCAB for i in ids[1:])
        out = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 12})
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out["output_ids"] == ref[0, len(ids):].tolist()


def _metadata_only_gguf(path, arch, layers, hidden, heads, key_length):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(4 * hidden)
    writer.add_head_count(heads)
    writer.add_key_length(key_length)
    writer.add_vocab_size(8)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()


def test_gemma2_gguf_query_scale_and_defaults_follow_llama_cpp(tmp_path):
    """The query scale GGUF does not store: hidden / heads for the 46-layer 27B (query_pre_attn_scalar 144), head_dim
    for the rest (2B, 9B: 256); soft-caps missing from the metadata take HF Gemma2Config's defaults."""
    from braid.runtime.loader.gguf import _read_gguf_config

    _metadata_only_gguf(str(tmp_path / "27b.gguf"), "gemma2", 46, 4608, 32, 128)
    _metadata_only_gguf(str(tmp_path / "9b.gguf"), "gemma2", 42, 3584, 16, 256)
    big, nine = _read_gguf_config(str(tmp_path / "27b.gguf")), _read_gguf_config(str(tmp_path / "9b.gguf"))
    assert big["query_pre_attn_scalar"] == 144 and nine["query_pre_attn_scalar"] == 256
    assert (nine["attn_logit_softcapping"], nine["final_logit_softcapping"]) == (50.0, 30.0)
    assert nine["sliding_window"] is None and nine["hidden_activation"] == "gelu_pytorch_tanh"


def test_unsupported_gguf_architecture_is_refused_clearly(tmp_path):
    """A GGUF of an architecture braid does not map fails at start with the reason and the ones it reads."""
    path = str(tmp_path / "phi3.gguf")
    _metadata_only_gguf(path, "phi3", 2, 64, 4, 16)
    with pytest.raises(ValueError, match="GGUF architecture 'phi3' is not supported .*gemma2"):
        Engine(model_path=path, tokenizer_path="smollm2", log_level="warning")


# ---------------------------------------------------------------------------------------------- the kernels

def _scattered_layout(seq_lens, h_kv, d, gen):
    """req_to_token [B, max len] over KV slots in random order (slot 0 unused), random K and V buffers."""
    total = sum(seq_lens)
    slots = torch.randperm(total, generator=gen) + 1
    req_to_token = torch.zeros((len(seq_lens), max(seq_lens)), dtype=torch.int32)
    k_buf = torch.randn(total + 1, h_kv, d, generator=gen)
    v_buf = torch.randn(total + 1, h_kv, d, generator=gen)
    off = 0
    for b, n in enumerate(seq_lens):
        req_to_token[b, :n] = slots[off:off + n].int()
        off += n
    return req_to_token, k_buf, v_buf


def _reference(q, keys, vals, q_pos, scale, cap, window):
    # q [n, H, D], keys/vals [L, Hkv, D] at positions 0..L-1 -> [n, H, D]
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, 1).transpose(0, 1)
    v = vals.repeat_interleave(group, 1).transpose(0, 1)
    s = torch.matmul(q.transpose(0, 1), k.transpose(1, 2)) * scale
    s = cap * torch.tanh(s / cap)
    k_pos = torch.arange(keys.shape[0])
    visible = (k_pos[None] <= q_pos[:, None]) & (k_pos[None] > q_pos[:, None] - window)
    s = s.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(s, -1), v).transpose(0, 1)


def test_triton_kernels_skip_keys_outside_the_window():
    """Extend with a cached prefix longer than W (and a chunk starting past it) and decode never read the KV of
    keys older than the window: their slots hold NaN and the outputs are finite and right."""
    from braid.runtime.layers.attention.triton_ops import decode_attention_fwd, extend_attention_fwd

    gen = torch.Generator().manual_seed(8)
    h, h_kv, d, cap, scale = 4, 2, 16, 3.0, 0.2
    prefix_lens, ext_lens = [40, 3, 50], [20, 30, 8]
    seq_lens = [p + e for p, e in zip(prefix_lens, ext_lens)]
    req_to_token, k_buf, v_buf = _scattered_layout(seq_lens, h_kv, d, gen)
    truth_k, truth_v = k_buf.clone(), v_buf.clone()
    rows = torch.arange(len(seq_lens))
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    q = torch.randn(sum(ext_lens), h, d, generator=gen)
    ext_k = torch.cat([truth_k[req_to_token[b, p:p + e].long()] for b, (p, e) in enumerate(zip(prefix_lens, ext_lens))])
    ext_v = torch.cat([truth_v[req_to_token[b, p:p + e].long()] for b, (p, e) in enumerate(zip(prefix_lens, ext_lens))])
    # the KV of keys older than every query's window becomes NaN: a kernel that reads it (even to mask it) gives NaN
    for b, p in enumerate(prefix_lens):
        old = req_to_token[b, :max(0, p - WINDOW + 1)].long()
        k_buf[old], v_buf[old] = float("nan"), float("nan")
    o = torch.full_like(q, float("nan"))
    start = torch.tensor([0] + ext_lens[:-1]).cumsum(0).int()
    extend_attention_fwd(q, ext_k, ext_v, o, k_buf, v_buf, req_to_token, rows, as_i32(seq_lens), as_i32(ext_lens),
                         start, as_i32(prefix_lens), max(ext_lens), scale, cap, WINDOW)
    assert torch.isfinite(o).all()
    for b, (p, e) in enumerate(zip(prefix_lens, ext_lens)):
        slots = req_to_token[b, :p + e].long()
        want = _reference(q[start[b]:start[b] + e], truth_k[slots], truth_v[slots], torch.arange(p, p + e), scale,
                          cap, WINDOW)
        assert (o[start[b]:start[b] + e] - want).abs().max() < 1e-4

    for b, n in enumerate(seq_lens):  # decode at position n - 1 sees n - W .. n - 1
        old = req_to_token[b, :max(0, n - WINDOW)].long()
        k_buf[old], v_buf[old] = float("nan"), float("nan")
    qd = torch.randn(len(seq_lens), h, d, generator=gen)
    od = torch.full_like(qd, float("nan"))
    scratch = torch.empty(len(seq_lens), h, 4, d + 1)
    decode_attention_fwd(qd, k_buf, v_buf, od, req_to_token, rows, as_i32(seq_lens), scratch, 4, scale, cap, WINDOW)
    assert torch.isfinite(od).all()
    for b, n in enumerate(seq_lens):
        slots = req_to_token[b, :n].long()
        want = _reference(qd[b:b + 1], truth_k[slots], truth_v[slots], torch.tensor([n - 1]), scale, cap, WINDOW)
        assert (od[b:b + 1] - want).abs().max() < 1e-4


def test_window_kv_lists_hold_exactly_the_keys_a_window_layer_sees():
    """FlashInfer plans window layers over trimmed KV lists (triton_ops/kv_indices.py): from the first query's window
    start to the end. With FlashInfer's mask convention (queries aligned to the list's end: key j visible to query i
    when i + L - n - window_left <= j <= i + L - n) those lists give the same attention as the full keys under
    braid's (p - W, p] window, in extend (cached prefixes, chunks) and decode."""
    from braid.runtime.layers.attention.triton_ops.kv_indices import build_kv_indices, csr_indptr, window_kv_spans

    gen = torch.Generator().manual_seed(11)
    seq_lens, qo_lens = [60, 9, 40, 17, 100], [12, 9, 1, 1, 30]  # extend on prefixes, a fresh prompt, decodes
    req_to_token = torch.randint(1, 1000, (7, 128), generator=gen, dtype=torch.int32)
    rows = torch.tensor([3, 0, 6, 2, 5])
    starts, lens = window_kv_spans(seq_lens, qo_lens, WINDOW)
    indptr = csr_indptr(lens)
    indices = torch.full((int(indptr[-1]) + 5,), -7, dtype=torch.int32)
    build_kv_indices(req_to_token, rows, indptr, indices, len(rows), kv_starts=torch.tensor(starts, dtype=torch.int32))
    h, d, scale, cap = 2, 16, 0.3, 3.0
    for b, (seq, n) in enumerate(zip(seq_lens, qo_lens)):
        got = indices[indptr[b]:indptr[b + 1]]
        assert torch.equal(got, req_to_token[rows[b], starts[b]:seq]) and starts[b] == max(0, seq - n - WINDOW + 1)
        keys, vals = torch.randn(seq, h, d, generator=gen), torch.randn(seq, h, d, generator=gen)
        q = torch.randn(n, h, d, generator=gen)
        want = _reference(q, keys, vals, torch.arange(seq - n, seq), scale, cap, WINDOW)
        # FlashInfer's view: L = lens[b] keys, queries aligned to their end, window_left = W - 1
        L, kk, vv = lens[b], keys[starts[b]:], vals[starts[b]:]
        i, j = torch.arange(n)[:, None], torch.arange(L)[None, :]
        visible = (j <= i + L - n) & (j >= i + L - n - (WINDOW - 1))
        s = torch.einsum("nhd,lhd->hnl", q, kk) * scale
        s = (cap * torch.tanh(s / cap)).masked_fill(~visible, float("-inf"))
        got_out = torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), vv)
        assert (got_out - want).abs().max() < 1e-5
    assert (indices[int(indptr[-1]):] == -7).all()  # nothing written past the lists


# ---------------------------------------------------------------------------------------------- on the GPU

GPU_WINDOW = 64


@pytest.fixture(scope="module")
def gpu_checkpoint(tmp_path_factory):
    """Gemma-2's head_dim 256 (the FlashInfer modules gemma2_8k_decode.sh prebuilds), window 64, on the GPU; HF's
    reference there in fp32 eager."""
    path = tmp_path_factory.mktemp("gemma2_gpu")
    cfg = _config(hidden_size=256, intermediate_size=512, num_hidden_layers=4, head_dim=256, sliding_window=GPU_WINDOW,
                  query_pre_attn_scalar=256, max_position_embeddings=1024)
    return str(path), _save(path, cfg).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("backend,dtype,tol", [("triton", "float32", 2e-3), ("triton", "bfloat16", 0.1),
                                               ("flashinfer", "bfloat16", 0.1)])
def test_gpu_backends_match_hf(gpu_checkpoint, backend, dtype, tol):
    """Prompts of 300/150/70 tokens in chunks of 128 (crossing the window), 40 decode steps through CUDA graphs, then
    a follow-up on the first request's cached prefix: the logprobs of braid's tokens equal HF's (fp32: also the
    greedy tokens); FlashInfer where it is installed, else a clear refusal."""
    import importlib.util

    path, hf = gpu_checkpoint
    kw = dict(chunked_prefill_size=128, cuda_graph_max_bs=4, max_total_tokens=8192)
    if backend == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
        with pytest.raises(ValueError, match="flashinfer"):
            _engine(path, backend, dtype=dtype, **kw)
        return
    gpu_results_match_hf(path, hf, backend, dtype, tol, [300, 150, 70], **kw)


def gpu_results_match_hf(path, hf, backend, dtype, tol, lengths, **engine_kw):
    """Random prompts of `lengths` and 40 greedy steps (decode through CUDA graphs), then a follow-up on the first
    request's cached prefix: the logprob of every token braid chose within `tol` of HF's (hf on the GPU, fp32 eager);
    in fp32 the greedy tokens equal HF's too."""
    prompts = _prompts(lengths, seed=9)
    sampling = {**GREEDY, "max_new_tokens": 40}
    with _engine(path, backend, dtype=dtype, **engine_kw) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=sampling, return_logprob=True)
        follow_up = prompts[0] + results[0]["output_ids"] + _prompts([20], seed=10)[0]
        results.append(engine.generate(input_ids=follow_up, sampling_params=sampling, return_logprob=True))
        assert engine.scheduler.runner.cuda_graph_runner.num_replays >= 39
    prompts.append(follow_up)
    worst = 0.0
    for prompt, res in zip(prompts, results):
        seq = prompt + res["output_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([seq], device="cuda")).logits[0].float(), -1).cpu()
            if dtype == "float32":
                ref = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=40, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
                assert res["output_ids"] == ref[0, len(prompt):].tolist()
        for k, (lp, tok) in enumerate(res["meta_info"]["output_token_logprobs"]):
            worst = max(worst, abs(lp - logp[len(prompt) - 1 + k, tok].item()))
    assert worst <= tol, f"{backend} {dtype}: max |Δlogprob| {worst:.2e}"
