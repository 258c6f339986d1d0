"""Extend passes through the padded static batch of ExtendCudaGraphRunner (what its CUDA graphs replay), against the
same passes run eagerly: a tiny random Llama on the Triton attention backend (TRITON_INTERPRET=1 on CPU; the graphs
themselves are captured on CUDA only, where the `gpu` case compares the engine's greedy output with and without
them)."""

from __future__ import annotations

import pytest
import torch

from braid.runtime.config import ServerArgs
from braid.runtime.core import ForwardBatch, ForwardMode
from braid.runtime.layers.attention.triton_backend import TritonAttnBackend
from braid.runtime.model_executor.cuda_graph import ExtendCudaGraphRunner, extend_token_buckets
from braid.runtime.model_executor.model_runner import ModelRunner
from byte_tokenizer import byte_tokenizer
from extend_graph_runs import greedy_eager_and_graphed


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import transformers

    path = tmp_path_factory.mktemp("tiny-llama-extend-graphs")
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    byte_tokenizer().save_pretrained(path)
    return str(path)


def _extend_batch(runner, rows, prefix_lens, new_tokens) -> ForwardBatch:
    """Requests at req_to_token rows `rows`, each with a cached prefix (already in the pool) and new tokens."""
    lens = [len(t) for t in new_tokens]
    loc = runner.kv_pool.alloc(sum(lens))
    offset = 0
    for row, p, n in zip(rows, prefix_lens, lens):
        runner.req_to_token_pool.req_to_token[row, p:p + n] = loc[offset:offset + n].to(torch.int32)
        offset += n
    dev = runner.device
    ext = torch.tensor(lens, dtype=torch.int32, device=dev)
    prefix = torch.tensor(prefix_lens, dtype=torch.int32, device=dev)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=len(rows),
        input_ids=torch.tensor([t for ts in new_tokens for t in ts], dtype=torch.int64, device=dev),
        positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, lens)]).to(dev),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=dev), seq_lens=ext + prefix, out_cache_loc=loc,
        seq_lens_cpu=[p + n for p, n in zip(prefix_lens, lens)], extend_prefix_lens=prefix, extend_seq_lens=ext,
        extend_start_loc=torch.cumsum(ext, 0, dtype=torch.int32) - ext, extend_prefix_lens_cpu=list(prefix_lens),
        extend_seq_lens_cpu=lens)


def _eager(runner, fb) -> torch.Tensor:
    fb.req_to_token_pool, fb.kv_pool, fb.attn_backend = (runner.req_to_token_pool, runner.kv_pool,
                                                                  runner.attn_backend)
    runner.attn_backend.init_forward_metadata(fb)
    return runner.model(fb)


def test_token_buckets_cover_every_count():
    buckets = extend_token_buckets(2048)
    assert buckets[0] == 16 and buckets[-1] == 2048 and buckets == sorted(set(buckets))
    # past 128 tokens a bucket is at most a quarter (from 256: an eighth) above the one before
    assert all(b / a <= 1.25 for a, b in zip(buckets[5:], buckets[6:]))
    assert all(b / a <= 1.125 for a, b in zip(buckets[9:], buckets[10:]))
    assert extend_token_buckets(100)[-1] == 100


@torch.inference_mode()
def test_padded_static_extend_equals_eager(tiny_llama):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = ServerArgs(model_path=tiny_llama, device=device, dtype="float32", max_total_tokens=1024,
                      cuda_graph_max_extend_tokens=64, cuda_graph_max_extend_reqs=4, disable_cuda_graph=True,
                      log_level="warning")
    runner = ModelRunner(args)
    runner.attn_backend = TritonAttnBackend(runner)  # a server refuses Triton on CPU; the interpreter runs it here
    assert runner.extend_graphs_unsupported() == ""
    graphs = ExtendCudaGraphRunner(runner, max_tokens=args.cuda_graph_max_extend_tokens, capture=False)
    assert graphs.token_buckets == [16, 32, 48, 64] and graphs.max_reqs == 4
    gen = torch.Generator().manual_seed(1)
    rows = [runner.req_to_token_pool.alloc() for _ in range(3)]
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (13, 7, 20)]

    # prefill of two requests (20 tokens -> the 32-token bucket, 2 of its 4 request rows)
    first = _extend_batch(runner, rows[:2], [0, 0], prompts[:2])
    assert graphs.can_run(first)
    expected = _eager(runner, first)
    got = graphs.replay(first)
    assert got.shape == expected.shape == (20, 64)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    # the first request continues past its cached prefix beside a new request: the prefix is read from the pool
    second = _extend_batch(runner, [rows[0], rows[2]], [13, 0], [[5, 6, 7, 8, 9], prompts[2]])
    expected = _eager(runner, second)
    got = graphs.replay(second)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert graphs.num_replays == 2

    # too many tokens or requests for the graphs: the runner says so (the pass then runs eagerly)
    assert not graphs.can_run(_extend_batch(runner, [rows[1]], [7], [list(range(3, 68))]))
    many = [runner.req_to_token_pool.alloc() for _ in range(5)]
    assert not graphs.can_run(_extend_batch(runner, many, [0] * 5, [[4, 5]] * 5))
    # a speculative tree verify pass (its new tokens attend through a tree mask) runs eagerly
    tree = _extend_batch(runner, [rows[1]], [7], [[4, 5, 6]])
    assert graphs.can_run(tree)
    tree.tree_mask = torch.tensor([1, 0, 0, 1, 1, 0, 1, 0, 1], dtype=torch.bool)
    tree.tree_mask_start = torch.zeros(1, dtype=torch.int64)
    assert not graphs.can_run(tree)


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory):
    import transformers

    path = tmp_path_factory.mktemp("tiny-gemma2-extend-graphs")
    cfg = transformers.Gemma2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=256, sliding_window=16, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=3.0, final_logit_softcapping=4.0)
    torch.manual_seed(0)
    transformers.Gemma2ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    byte_tokenizer().save_pretrained(path)
    return str(path)


@torch.inference_mode()
def test_padded_static_extend_equals_eager_over_a_window_trimmed_pool(tiny_gemma2):
    """Gemma-2 (window layers in a trimmed pool, soft-caps): inside the padded static pass the window slots of the
    requests' rows and of the new tokens are translated into static buffers; == the eager pass, a cached prefix
    longer than the window included."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = ServerArgs(model_path=tiny_gemma2, device=device, dtype="float32", max_total_tokens=1024,
                      cuda_graph_max_extend_tokens=64, cuda_graph_max_extend_reqs=4, disable_cuda_graph=True,
                      log_level="warning")
    runner = ModelRunner(args)
    runner.attn_backend = TritonAttnBackend(runner)
    assert hasattr(runner.kv_pool, "window_rows")
    assert runner.extend_graphs_unsupported() == ""
    graphs = ExtendCudaGraphRunner(runner, max_tokens=64, capture=False)
    gen = torch.Generator().manual_seed(4)
    rows = [runner.req_to_token_pool.alloc() for _ in range(2)]
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (40, 9)]
    for batch in (_extend_batch(runner, rows, [0, 0], prompts),
                  _extend_batch(runner, rows[:1], [40], [torch.randint(3, 300, (12,), generator=gen).tolist()])):
        expected = _eager(runner, batch)
        torch.testing.assert_close(graphs.replay(batch), expected, rtol=1e-5, atol=1e-5)


def test_flags_are_checked_and_shown():
    with pytest.raises(ValueError, match="cuda_graph_max_extend_tokens"):
        ServerArgs(cuda_graph_max_extend_tokens=-1)
    with pytest.raises(ValueError, match="cuda_graph_max_extend_reqs"):
        ServerArgs(cuda_graph_max_extend_reqs=0)


@pytest.mark.gpu
def test_gpu_engine_greedy_equal_with_extend_graphs(tiny_llama):
    from braid.runtime import Engine

    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(3, 300, (40,), generator=gen).tolist()
    # lengths across several buckets, a batch of many short prompts, and prompts reusing a cached prefix
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 17, 33, 70, 150)]
    prompts += [shared + [7 + i] * (i + 1) for i in range(6)]
    greedy = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    outputs, logprobs, stats = [], [], []
    for tokens in (0, None):  # eager; the default (1024 tokens on CUDA)
        # fp32: padded GEMMs may take other cuBLAS kernels, whose bf16 rounding would flip a random model's near-ties
        with Engine(model_path=tiny_llama, log_level="warning", device="cuda", dtype="float32",
                    attention_backend="triton", max_total_tokens=4096, cuda_graph_max_extend_tokens=tokens) as e:
            first = e.generate(input_ids=prompts, sampling_params=greedy, return_logprob=True, logprob_start_len=0)
            again = e.generate(input_ids=prompts[5:], sampling_params=greedy)  # prefixes from the radix cache
            outputs.append([r["output_ids"] for r in first + again])
            logprobs.append(torch.tensor([x for r in first for x, _ in r["meta_info"]["input_token_logprobs"][1:]]))
            stats.append(e.scheduler.get_stats())
    assert outputs[0] == outputs[1]
    torch.testing.assert_close(logprobs[1], logprobs[0], rtol=0, atol=1e-4)
    assert stats[0]["num_forward_extend_graphed"] == 0
    assert stats[1]["num_forward_extend_graphed"] == stats[1]["num_forward_extend"] > 0
    assert stats[1]["kv_used_tokens"] == 0


@pytest.mark.gpu
def test_gpu_gemma2_greedy_equal_with_extend_graphs(tiny_gemma2):
    """On CUDA: Gemma-2 over the window-trimmed pool, extends replayed from graphs == eager, with prompts and cached
    prefixes longer than the window."""
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 300, (40,), generator=gen).tolist()
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (7, 30, 90)]
    prompts += [shared + [7 + i] * (i + 1) for i in range(4)]
    outputs, graphed = greedy_eager_and_graphed(tiny_gemma2, prompts, reused_from=3, graph_tokens=512,
                                                max_new_tokens=24, attention_backend="triton")
    assert outputs[0] == outputs[1]
    assert graphed[0] == 0 and graphed[1] > 0


@torch.inference_mode()
def test_padded_static_extend_serves_lora_rows_as_the_eager_pass(tmp_path):
    """LoRA under the graphs: the padded static pass reads each token's adapter slot from the runner's static index
    buffer (what a captured graph reads on replay) and equals the eager pass, for a batch mixing two adapters and
    the base model, and for a batch of the base model alone after it (the buffer's old slots must not linger)."""
    from lora_tiny import ADAPTERS, VOCAB, write_all

    paths = write_all(tmp_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = ServerArgs(model_path=paths["base"], device=device, dtype="float32", max_total_tokens=1024,
                      cuda_graph_max_extend_tokens=64, cuda_graph_max_extend_reqs=4, disable_cuda_graph=True,
                      lora_paths=[f"{n}={paths[n]}" for n in ADAPTERS], log_level="warning")
    runner = ModelRunner(args)
    runner.attn_backend = TritonAttnBackend(runner)
    graphs = ExtendCudaGraphRunner(runner, max_tokens=64, capture=False)
    assert graphs.lora_idx is not None and graphs.lora_idx.shape == (64,)
    gen = torch.Generator().manual_seed(5)
    rows = [runner.req_to_token_pool.alloc() for _ in range(3)]
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (11, 6, 9)]

    def run_both(batch, names):
        batch.lora_paths = names
        runner.lora_manager.prepare(batch)
        expected = _eager(runner, batch)
        runner.lora_manager.clear()
        return expected, graphs.replay(batch)

    mixed = _extend_batch(runner, rows, [0, 0, 0], prompts)
    expected, got = run_both(mixed, ["sql", None, "router"])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    slots = [runner.lora_manager.slot_of(n) for n in ("sql", "router")]
    assert graphs.lora_idx[:26].tolist() == [slots[0]] * 11 + [-1] * 6 + [slots[1]] * 9
    assert (graphs.lora_idx[26:32] == -1).all()  # the 32-token bucket's padding rows: the base model
    runner.lora_manager.prepare(mixed)  # the adapters do change the pass (so the comparison above can fail)
    with_adapters = _eager(runner, mixed)
    mixed.lora_paths = None
    runner.lora_manager.prepare(mixed)
    assert not torch.allclose(with_adapters[:11], _eager(runner, mixed)[:11], atol=1e-3)

    base_only = _extend_batch(runner, rows[1:2], [6], [[7, 8, 9, 10]])
    expected, got = run_both(base_only, None)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (graphs.lora_idx[:16] == -1).all() and runner.lora_manager.batch.idx is None
