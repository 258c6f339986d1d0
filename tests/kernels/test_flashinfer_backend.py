"""FlashInferAttnBackend vs TorchAttnBackend: extend over cached prefixes, decode (eager and under CUDA graphs
captured by the real CudaGraphRunner, replayed at padded batch sizes), sliding window, soft cap, GQA 1/3/4/8,
head_dim 64 and 128, bf16, and fp8 KV caches (e5m2; e4m3 with per-layer scales).

The whole module is skipped where flashinfer is not installed (CI). The construction checks and the kv-indices
kernel run on CPU too (the kernel under TRITON_INTERPRET=1); the cases marked `gpu` need CUDA.

FlashInfer JIT-compiles a module per (head_dim, sliding window on/off, soft cap on/off) and kernel family the
first time it is planned; the GPU cases stick to three of them (prefill kernels at D128 plain and at D64 with
window and cap, which also serve decode at GQA >= 4; CUDA-core decode at D64 plain), built in parallel once.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("flashinfer") is None:
    pytest.skip("flashinfer is not installed here", allow_module_level=True)
# installed but failing to import is an error worth seeing, not a skip
import braid.runtime.layers.attention.flashinfer_backend as fib  # noqa: E402

from braid.runtime.core import ForwardBatch, ForwardMode  # noqa: E402
from braid.runtime.layers.attention.torch_backend import TorchAttnBackend  # noqa: E402
from braid.runtime.layers.radix_attention import RadixAttention  # noqa: E402
from braid.runtime.mem_cache.pools import MHAKVPool, ReqToTokenPool  # noqa: E402

FlashInferAttnBackend = fib.FlashInferAttnBackend

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
BF16 = torch.bfloat16
TOL = 1e-2


def runner_for(h, h_kv, d, dtype=BF16, device=DEVICE, **extra):
    mc = SimpleNamespace(num_attention_heads=h, num_key_value_heads=h_kv, head_dim=d, v_head_dim=extra.pop("dv", d),
                         attention_arch=extra.pop("arch", "mha"))
    return SimpleNamespace(device=device, dtype=dtype, model_config=mc, tp_size=1, **extra)


# ---------------------------------------------------------------------------------- runs everywhere flashinfer imports


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype=torch.float32), "float16/bfloat16"),
    (dict(d=96), "head_dim"),
    (dict(dv=64), "equal key and value head dims"),
    (dict(arch="mla"), "MLA"),
    (dict(kv_pool=SimpleNamespace(dtype=BF16, cache_dtype=torch.float16)), "model dtype .* or fp8"),
    (dict(device=torch.device("cpu")), "CUDA device"),
])
def test_unsupported_configurations_are_rejected_at_construction(kwargs, match):
    args = dict(h=8, h_kv=2, d=128)
    for key in ("dtype", "d"):
        if key in kwargs:
            args[key] = kwargs.pop(key)
    with pytest.raises(ValueError, match=match):
        FlashInferAttnBackend(runner_for(**args, **kwargs))


def test_window_maps_to_flashinfer_window_left():
    # braid's W: a query at p sees (p - W, p]; FlashInfer's window_left L: [p - L, p]
    layer = RadixAttention(0, 8, 64, 2, scaling=0.125, sliding_window=4096, logit_cap=30.0)
    v = fib._variant_of(layer)
    assert (v.window_left, v.logit_cap, v.sm_scale) == (4095, 30.0, 0.125)
    assert fib._variant_of(RadixAttention(0, 8, 64, 2, scaling=0.125)).window_left == -1


def test_kv_indices_concatenate_each_requests_slots():
    gen = torch.Generator().manual_seed(3)
    req_to_token = torch.randint(1, 10_000, (6, 1500), generator=gen, dtype=torch.int32).to(DEVICE)
    rows = torch.tensor([4, 0, 5, 2], device=DEVICE)
    lens = [1, 1100, 513, 7]
    indptr_cpu = fib._indptr(lens)
    assert indptr_cpu.tolist() == [0, 1, 1101, 1614, 1621]
    out = torch.full((indptr_cpu[-1].item() + 3,), -1, dtype=torch.int32, device=DEVICE)
    fib.build_kv_indices(req_to_token, rows, indptr_cpu.to(DEVICE), out, len(lens))
    expect = torch.cat([req_to_token[r, :n] for r, n in zip(rows.tolist(), lens)])
    assert torch.equal(out[:-3], expect) and (out[-3:] == -1).all()


# ---------------------------------------------------------------------------------- GPU: JIT modules


@pytest.fixture(scope="module")
def jit_modules():
    """Compiles the three FlashInfer modules the GPU cases use side by side (one after another, each waits on its
    slowest nvcc file: about 90 s per prefill module on 2 cores).

    Best effort: anything that fails here is built (and reported) by plan() itself."""
    try:
        from flashinfer.jit.attention import modules as m

        i32 = torch.int32
        specs = [
            m._gen_batch_prefill_primary_module("fa2", BF16, BF16, BF16, i32, 128, 128, 0, False, False, False),
            m._gen_batch_prefill_primary_module("fa2", BF16, BF16, BF16, i32, 64, 64, 0, True, True, False),
            m.gen_batch_decode_module(BF16, BF16, BF16, i32, 64, 64, 0, False, False),
        ]
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"could not prebuild the FlashInfer modules ({type(e).__name__}: {e}); plan() builds them")
        return
    with ThreadPoolExecutor(len(specs)) as pool:
        for spec, fut in [(s, pool.submit(s.build, need_lock=True)) for s in specs]:
            try:
                fut.result()
            except Exception as e:  # noqa: BLE001
                warnings.warn(f"prebuilding {spec.name} failed ({type(e).__name__}: {e}); plan() builds it")


# ---------------------------------------------------------------------------------- GPU: harness


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "output has NaN"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


class Setup:
    """A KV pool and req_to_token table shared by both backends; requests live at rows of req_to_token, their
    tokens at random, non-contiguous KV slots (slot 0 stays the dummy)."""

    def __init__(self, h, h_kv, d, layer_opts, num_slots=24_000, max_reqs=8, max_context=2304, seed=0,
                 kv_cache_dtype=None, kv_scales=(1.0, 1.0)):
        self.h, self.h_kv, self.d = h, h_kv, d
        self.gen = torch.Generator().manual_seed(seed)
        self.layers = [RadixAttention(i, h, d, h_kv, scaling=d ** -0.5, sliding_window=w, logit_cap=cap)
                       for i, (w, cap) in enumerate(layer_opts)]
        self.pool = MHAKVPool(num_slots, BF16, h_kv, d, len(self.layers), DEVICE, kv_cache_dtype=kv_cache_dtype,
                              k_scale=kv_scales[0], v_scale=kv_scales[1])
        self.r2t = ReqToTokenPool(max_reqs, max_context, DEVICE)
        self.free = (torch.randperm(num_slots, generator=self.gen) + 1).tolist()
        self.filled = [0] * max_reqs
        self.torch_backend = TorchAttnBackend()

    def randn(self, *shape, scale=1.0):
        return (torch.randn(*shape, generator=self.gen) * scale).to(BF16).to(DEVICE)

    def alloc(self, row, n):
        slots = torch.tensor([self.free.pop() for _ in range(n)], dtype=torch.int64, device=DEVICE)
        start = self.filled[row]
        self.r2t.req_to_token[row, start:start + n] = slots.int()
        self.filled[row] += n
        return slots

    def fill_prefix(self, row, n):
        """n cached tokens with random K/V, as if an earlier pass had computed them."""
        if n == 0:
            return
        slots = self.alloc(row, n)
        for layer in self.layers:
            self.pool.set_kv(layer.layer_id, slots, self.randn(n, self.h_kv, self.d),
                             self.randn(n, self.h_kv, self.d))

    def batch(self, mode, rows, new_lens):
        prefix = [self.filled[r] for r in rows]
        locs = torch.cat([self.alloc(r, n) for r, n in zip(rows, new_lens)])
        seq = [p + n for p, n in zip(prefix, new_lens)]
        i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
        fb = ForwardBatch(
            forward_mode=mode, batch_size=len(rows),
            input_ids=torch.zeros(sum(new_lens), dtype=torch.int64, device=DEVICE),
            positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix, seq)]).to(DEVICE),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=DEVICE), seq_lens=i32(seq),
            out_cache_loc=locs, seq_lens_cpu=seq, req_to_token_pool=self.r2t, kv_pool=self.pool)
        if mode == ForwardMode.EXTEND:
            fb.extend_prefix_lens, fb.extend_seq_lens = i32(prefix), i32(new_lens)
            fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = prefix, list(new_lens)
            fb.extend_start_loc = i32([0] + list(new_lens[:-1])).cumsum(0).int()
        return fb

    def qkv(self, tokens):
        # q scaled up so that the soft cap changes the scores noticeably
        return [(self.randn(tokens, self.h * self.d, scale=3.0), self.randn(tokens, self.h_kv * self.d),
                 self.randn(tokens, self.h_kv * self.d)) for _ in self.layers]

    def run(self, backend, fb, qkv):
        fb = dataclasses.replace(fb, attn_backend=backend, attn_metadata=None)
        with torch.inference_mode():
            backend.init_forward_metadata(fb)
            return [backend.forward(q, k, v, layer, fb) for layer, (q, k, v) in zip(self.layers, qkv)]

    def compare(self, fi, fb, qkv):
        """Runs the batch through FlashInfer, then the torch reference (its K/V writes repeat FlashInfer's)."""
        out = self.run(fi, fb, qkv)
        ref = self.run(self.torch_backend, fb, qkv)
        return [rel_err(o, r) for o, r in zip(out, ref)]


# ---------------------------------------------------------------------------------- GPU: eager extend and decode

# name: (H, Hkv, D, sliding_window, logit_cap)
EXTEND_CASES = {
    "gqa4_d128": (32, 8, 128, -1, 0.0),
    "mha_d64_window_cap": (8, 8, 64, 48, 5.0),
    "gqa8_d64_window_cap": (32, 4, 64, 48, 5.0),
}
DECODE_CASES = {
    "mha_d64": (8, 8, 64, -1, 0.0),  # CUDA-core decode kernel
    "gqa3_d64": (9, 3, 64, -1, 0.0),  # SmolLM2-135M's heads, CUDA-core kernel
    "gqa4_d128": (32, 8, 128, -1, 0.0),  # tensor-core (prefill) kernel from here on
    "gqa8_d128": (32, 4, 128, -1, 0.0),
    "gqa4_d64_window_cap": (16, 4, 64, 48, 5.0),
    "gqa8_d64_window_cap": (32, 4, 64, 48, 5.0),
}


@pytest.mark.gpu
@pytest.mark.usefixtures("jit_modules")
@pytest.mark.parametrize("name", list(EXTEND_CASES))
def test_gpu_extend_with_cached_prefixes(name):
    h, h_kv, d, window, cap = EXTEND_CASES[name]
    s = Setup(h, h_kv, d, [(window, cap)])
    fi = FlashInferAttnBackend(runner_for(h, h_kv, d, kv_pool=s.pool))
    rows, prefix, new = [3, 0, 6, 1, 4], [0, 300, 1100, 77, 5], [513, 1, 200, 129, 64]
    for r, p in zip(rows, prefix):
        s.fill_prefix(r, p)
    fb = s.batch(ForwardMode.EXTEND, rows, new)
    errs = s.compare(fi, fb, s.qkv(sum(new)))
    assert max(errs) <= TOL, errs


@pytest.mark.gpu
@pytest.mark.usefixtures("jit_modules")
@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_gpu_decode(name):
    h, h_kv, d, window, cap = DECODE_CASES[name]
    s = Setup(h, h_kv, d, [(window, cap)])
    fi = FlashInferAttnBackend(runner_for(h, h_kv, d, kv_pool=s.pool))
    rows, cached = [2, 5, 0, 7, 1, 3], [0, 16, 299, 1024, 2047, 47]
    for r, p in zip(rows, cached):
        s.fill_prefix(r, p)
    errs = []
    for _ in range(2):  # the second step re-plans the same wrappers
        fb = s.batch(ForwardMode.DECODE, rows, [1] * len(rows))
        errs += s.compare(fi, fb, s.qkv(len(rows)))
    assert max(errs) <= TOL, errs


@pytest.mark.gpu
@pytest.mark.usefixtures("jit_modules")
def test_gpu_layers_with_different_windows_in_one_batch():
    # Gemma-2 style: sliding-window and global layers (here two windows, one compiled module) planned per batch
    h, h_kv, d = 32, 4, 64
    s = Setup(h, h_kv, d, [(32, 5.0), (200, 5.0), (32, 5.0)])
    fi = FlashInferAttnBackend(runner_for(h, h_kv, d, kv_pool=s.pool))
    rows = [1, 4, 6]
    for r, p in zip(rows, [40, 0, 700]):
        s.fill_prefix(r, p)
    errs = s.compare(fi, s.batch(ForwardMode.EXTEND, rows, [300, 257, 33]), s.qkv(590))
    errs += s.compare(fi, s.batch(ForwardMode.DECODE, rows, [1, 1, 1]), s.qkv(3))
    assert max(errs) <= TOL, errs
    assert len(fi._variants) == 2


# fp8 KV: both backends read the same fp8 values (the torch reference upcasts and scales them), so the tolerance is
# the bf16 one. e4m3 with scales far from 1 (k 0.5, v 4): dropping either scale in FlashInfer moves the output by
# far more than TOL. (Each new dtype pair JIT-compiles FlashInfer modules: e4m3 at D128 is in the graph case below.)
FP8_KV_CASES = {
    "e5m2_gqa4_d128": ("fp8_e5m2", (1.0, 1.0), 32, 8, 128, -1, 0.0),
    "e4m3_scaled_mha_d64_window_cap": ("fp8_e4m3", (0.5, 4.0), 8, 8, 64, 48, 5.0),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FP8_KV_CASES))
def test_gpu_fp8_kv_extend_and_decode(name):
    kv_dtype, scales, h, h_kv, d, window, cap = FP8_KV_CASES[name]
    s = Setup(h, h_kv, d, [(window, cap)], kv_cache_dtype=kv_dtype, kv_scales=scales)
    assert s.pool.is_fp8 and s.pool.kv_scales(0) == scales
    fi = FlashInferAttnBackend(runner_for(h, h_kv, d, kv_pool=s.pool))
    assert fi.kv_is_fp8 and fi.kv_dtype == s.pool.cache_dtype
    rows, prefix, new = [3, 0, 6], [0, 300, 1100], [129, 1, 64]
    for r, p in zip(rows, prefix):
        s.fill_prefix(r, p)
    errs = s.compare(fi, s.batch(ForwardMode.EXTEND, rows, new), s.qkv(sum(new)))
    for _ in range(2):
        errs += s.compare(fi, s.batch(ForwardMode.DECODE, rows, [1] * len(rows)), s.qkv(len(rows)))
    assert max(errs) <= TOL, errs


# ---------------------------------------------------------------------------------- GPU: CUDA graphs


class TinyModel(torch.nn.Module):
    """The layers' inputs come from static buffers (written before each replay), like a model's input ids."""

    def __init__(self, setup: Setup, max_bs: int):
        super().__init__()
        self.attn = torch.nn.ModuleList(setup.layers)
        n = len(setup.layers)
        self.q = torch.zeros(n, max_bs, setup.h * setup.d, dtype=BF16, device=DEVICE)
        self.k = torch.zeros(n, max_bs, setup.h_kv * setup.d, dtype=BF16, device=DEVICE)
        self.v = torch.zeros(n, max_bs, setup.h_kv * setup.d, dtype=BF16, device=DEVICE)

    def forward(self, fb):
        bs = fb.batch_size
        return torch.cat([layer(self.q[i, :bs], self.k[i, :bs], self.v[i, :bs], fb)
                          for i, layer in enumerate(self.attn)], dim=-1)

    def set_inputs(self, qkv):
        self.q.zero_(), self.k.zero_(), self.v.zero_()
        for i, (q, k, v) in enumerate(qkv):
            self.q[i, :q.shape[0]] = q
            self.k[i, :k.shape[0]] = k
            self.v[i, :v.shape[0]] = v


# name: (H, Hkv, D, [(sliding_window, logit_cap) per layer])
GRAPH_CASES = {
    "gqa8_d128": (32, 4, 128, [(-1, 0.0)]),  # tensor-core decode wrappers in graph mode
    "mha_d64": (8, 8, 64, [(-1, 0.0)]),  # CUDA-core decode wrappers in graph mode
    "gqa8_d64_two_windows_cap": (32, 4, 64, [(32, 5.0), (200, 5.0)]),
    # fp8_e4m3 KV with scales: the scales are host floats the captured graphs hold
    "gqa8_d128_fp8_e4m3_scaled": (32, 4, 128, [(-1, 0.0)], "fp8_e4m3", (0.5, 4.0)),
}


@pytest.mark.gpu
@pytest.mark.usefixtures("jit_modules")
@pytest.mark.parametrize("name", list(GRAPH_CASES))
def test_gpu_decode_cuda_graph_capture_and_padded_replay(name):
    from braid.runtime.model_executor.cuda_graph import CudaGraphRunner

    h, h_kv, d, layer_opts, *kv = GRAPH_CASES[name]
    max_bs = 8
    s = Setup(h, h_kv, d, layer_opts, **dict(zip(("kv_cache_dtype", "kv_scales"), kv)))
    model = TinyModel(s, max_bs)
    runner = runner_for(h, h_kv, d, kv_pool=s.pool, model=model, req_to_token_pool=s.r2t,
                        server_args=SimpleNamespace(cuda_graph_max_bs=max_bs, cuda_graph_bs=None,
                                                    enable_torch_compile=False))
    fi = runner.attn_backend = FlashInferAttnBackend(runner)
    assert len(fi._variants) == len(set(layer_opts))  # read from the model's RadixAttention layers

    rows = [0, 1, 2, 3, 4, 5, 6, 7]
    cached = [0, 5, 300, 1500, 64, 33, 999, 2]
    prompt_rows = rows[:6]
    for r, p in zip(rows[6:], cached[6:]):
        s.fill_prefix(r, p)
    # prompts through FlashInfer's eager extend (compared with the reference as well)
    errs = s.compare(fi, s.batch(ForwardMode.EXTEND, prompt_rows, [max(n, 1) for n in cached[:6]]),
                     s.qkv(sum(max(n, 1) for n in cached[:6])))

    graphs = CudaGraphRunner(runner)
    assert graphs.batch_sizes == [1, 2, 3, 4, 8]
    # batches of 5, 6 and 7 replay the graph captured at 8 (padded); 3, 8 and 1 their own
    for step_rows in (rows[:5], rows[5:], rows[:6], rows, rows[:7], [3]):
        fb = s.batch(ForwardMode.DECODE, step_rows, [1] * len(step_rows))
        qkv = s.qkv(len(step_rows))
        model.set_inputs(qkv)
        with torch.inference_mode():
            out = graphs.replay(dataclasses.replace(fb, attn_backend=fi)).clone()
        ref = torch.cat(s.run(s.torch_backend, fb, qkv), dim=-1)
        errs.append(rel_err(out, ref))
    assert max(errs) <= TOL, errs
    assert (graphs.num_replays, graphs.num_padded_replays) == (6, 3)
    assert set(fi._graph_wrappers) == {1, 2, 3, 4, 8}
    assert all(len(ws) == len(fi._variants) for ws in fi._graph_wrappers.values())
