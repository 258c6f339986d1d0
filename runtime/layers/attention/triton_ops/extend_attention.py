"""Triton prefill/extend attention over the paged KV cache (page size 1).

The new tokens of request b are rows `extend_start_loc[b] : extend_start_loc[b] + extend_seq_lens[b]`
of q/k/v_extend. They attend to
  * the request's cached prefix: `prefix_lens[b]` tokens whose KV slots are
    `req_to_token[req_pool_indices[b], :prefix_lens[b]]`, read from k_buffer/v_buffer, and
  * causally to the new tokens themselves, read from k_extend/v_extend.

Tree mask (speculative tree verify): instead of causally, request b's new tokens see each other where its
[n_b, n_b] bool mask (row-major at tree_mask[tree_mask_start[b]:]) is True; a node's ancestors come before it.

Sliding window W > 0: a query at absolute position p sees the keys at positions (p - W, p], i.e. the
last W keys including itself (the Gemma-2 / Mistral convention). Soft-capping (logit_cap > 0):
scores = cap * tanh(scores * sm_scale / cap). Accumulation is fp32; the output takes o_extend's dtype.
KV buffers may hold fp8 (e5m2 / e4m3fn): tiles are upcast in-kernel before each dot, and values read
from the buffers are multiplied by k_scale / v_scale (the pool stores x / scale).

Grid: one program per (request, head, query block of BLOCK_M), sized from the longest run on the host; or, with a
block table (`extend_block_table`, built on the device), one program per (table entry, head) with a grid fixed by
the padded token count and request count, which is what a CUDA graph of an extend pass needs.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

__all__ = ["extend_attention_fwd", "extend_block_m", "extend_block_table"]


@triton.jit
def _mm(a, b, DOT_DTYPE: tl.constexpr):
    """a @ b in DOT_DTYPE with an fp32 result. fp32 uses three tf32 products (about fp32 accuracy on
    tensor cores; an "ieee" dot of these tile sizes takes minutes to compile)."""
    if DOT_DTYPE == tl.float32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")
    else:
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE))


@triton.jit
def _scale_scores(qk, sm_scale, logit_cap, USE_CAP: tl.constexpr):
    """Raw q.k -> scores in log2 units (so the softmax can use exp2)."""
    if USE_CAP:
        # cap * tanh(x / cap); tanh through sigmoid so the interpreter and every GPU build agree
        x = qk * sm_scale
        x = logit_cap * (2.0 * tl.sigmoid(2.0 * x / logit_cap) - 1.0)
        return x * 1.4426950408889634
    else:
        return qk * (sm_scale * 1.4426950408889634)


@triton.jit
def _upcast_before_staging(v, DOT_DTYPE: tl.constexpr):
    """v in DOT_DTYPE, converted where it was loaded. Left to itself the compiler moves an upcast past the shared-memory
    staging of a dot operand, and an 8-bit V tile (keys x head dims, the keys axis reduced) then leaves shared memory a
    byte per load: 128 LDS.U8 per 64-key tile on sm90. The opaque copy keeps the conversion ahead, so the staged tile
    is 16-bit and the dot reads it with transposing ldmatrix, as for a bf16 cache."""
    upcast = v.to(DOT_DTYPE)
    return tl.inline_asm_elementwise("mov.b16 $0, $1;", "=h,h", [upcast], dtype=upcast.dtype, is_pure=False, pack=1)


@triton.jit
def _online_softmax_step(acc, m_i, l_i, s, v, v_scale, V_SCALED: tl.constexpr, DOT_DTYPE: tl.constexpr,
                         STAGE_V: tl.constexpr):
    """One flash-attention update. s: [M, N] log2-unit scores (-inf where masked), v: [N, DV] (times v_scale).
    STAGE_V: v is an fp8 tile to upcast before its shared-memory staging (GPU only)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # rows with nothing visible yet keep m = -inf; subtract 0 there so exp2 yields 0, not NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_SCALED:
        p = p * v_scale
    if STAGE_V:
        v = _upcast_before_staging(v, DOT_DTYPE)
    acc = acc * alpha[:, None] + _mm(p, v, DOT_DTYPE)
    return acc, m_new, l_i


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, qpe, q_idx, kv_idx, rows, mask_n, tree_vis,
    K_head, V_head, stride_ks, stride_vs, offs_d, mask_d, offs_dpe, mask_dpe, offs_dv, mask_dv,
    sm_scale, logit_cap, sliding_window, v_scale,
    BLOCK_DPE: tl.constexpr, MASK_N: tl.constexpr, CAUSAL: tl.constexpr, USE_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr, V_SCALED: tl.constexpr, DOT_DTYPE: tl.constexpr, STAGE_V: tl.constexpr,
    TREE: tl.constexpr,
):
    """Attend the query tile to BLOCK_N keys stored at `rows` [N] of K_head/V_head (one KV head's base).

    q_idx [M] and kv_idx [N] are positions on one axis (for the causal and window masks); mask_n [N]
    marks real keys and is only applied when MASK_N (tiles known to be full skip every mask); with TREE,
    tree_vis [M, N] (bool) marks the keys each query sees (a tree-masked extend; a placeholder, unread, without).
    """
    if MASK_N:
        k_mask = mask_n[None, :] & mask_d[:, None]
        v_mask = mask_n[:, None] & mask_dv[None, :]
    else:
        k_mask = mask_d[:, None]
        v_mask = mask_dv[None, :]
    # k: [BLOCK_D, BLOCK_N]
    k = tl.load(K_head + rows[None, :] * stride_ks + offs_d[:, None], mask=k_mask, other=0.0)
    qk = _mm(q, k, DOT_DTYPE)
    if BLOCK_DPE > 0:
        if MASK_N:
            kpe_mask = mask_n[None, :] & mask_dpe[:, None]
        else:
            kpe_mask = mask_dpe[:, None]
        kpe = tl.load(K_head + rows[None, :] * stride_ks + offs_dpe[:, None], mask=kpe_mask, other=0.0)
        qk += _mm(qpe, kpe, DOT_DTYPE)
    s = _scale_scores(qk, sm_scale, logit_cap, USE_CAP)
    if MASK_N or CAUSAL or USE_WINDOW or TREE:
        visible = mask_n[None, :]
        if TREE:
            visible = visible & tree_vis
        if CAUSAL:
            visible = visible & (kv_idx[None, :] <= q_idx[:, None])
        if USE_WINDOW:
            visible = visible & (kv_idx[None, :] > q_idx[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
    # v: [BLOCK_N, BLOCK_DV]
    v = tl.load(V_head + rows[:, None] * stride_vs + offs_dv[None, :], mask=v_mask, other=0.0)
    return _online_softmax_step(acc, m_i, l_i, s, v, v_scale, V_SCALED, DOT_DTYPE, STAGE_V)


@triton.jit
def _extend_fwd_kernel(
    Q, K_ext, V_ext, O, K_buf, V_buf, Req_to_token,
    B_req_idx, B_start_loc, B_ext_len, B_prefix_len, Block_seq, Block_m, Tree_mask, Tree_start,
    sm_scale, logit_cap, sliding_window, k_scale, v_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_req,
    KV_GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_CAP: tl.constexpr, USE_WINDOW: tl.constexpr, V_SCALED: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_TABLE: tl.constexpr, TREE: tl.constexpr,
):
    cur_head = tl.program_id(1)
    if BLOCK_TABLE:
        # entry -> (request, query block); -1 marks the entries past the batch's blocks
        cur_seq = tl.load(Block_seq + tl.program_id(0))
        if cur_seq < 0:
            return
        cur_block_m = tl.load(Block_m + tl.program_id(0))
    else:
        cur_seq = tl.program_id(0)
        cur_block_m = tl.program_id(2)
    cur_kv_head = cur_head // KV_GROUP

    ext_len = tl.load(B_ext_len + cur_seq)
    block_start = cur_block_m * BLOCK_M
    if block_start >= ext_len:
        return
    # the unmasked below-diagonal tiles need block_start to be a whole number of key tiles
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    ext_start = tl.load(B_start_loc + cur_seq)
    prefix_len = tl.load(B_prefix_len + cur_seq)
    req_row = Req_to_token + tl.load(B_req_idx + cur_seq).to(tl.int64) * stride_req

    offs_m = block_start + tl.arange(0, BLOCK_M)  # query index within this request's new tokens
    mask_m = offs_m < ext_len
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < DV

    q_rows = (ext_start + offs_m).to(tl.int64)
    q_ptrs = Q + q_rows[:, None] * stride_qt + cur_head * stride_qh
    # q: [BLOCK_M, BLOCK_D]; qpe: the head dims past the largest power of two (rope part of 576 = 512 + 64)
    q = tl.load(q_ptrs + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if BLOCK_DPE > 0:
        offs_dpe = BLOCK_D + tl.arange(0, BLOCK_DPE)
        mask_dpe = offs_dpe < D
        qpe = tl.load(q_ptrs + offs_dpe[None, :], mask=mask_m[:, None] & mask_dpe[None, :], other=0.0)
    else:  # unused placeholders
        offs_dpe, mask_dpe, qpe = offs_d, mask_d, q

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # ---- the cached prefix, gathered through req_to_token (positions 0 .. prefix_len) ----
    K_buf_h = K_buf + cur_kv_head * stride_kbh
    V_buf_h = V_buf + cur_kv_head * stride_vbh
    q_pos = prefix_len + offs_m
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(0, prefix_len + block_start - sliding_window + 1)
    full_hi = lo + tl.maximum(prefix_len - lo, 0) // BLOCK_N * BLOCK_N
    for start_n in range(lo, full_hi, BLOCK_N):
        offs_kv = start_n + offs_n
        rows = tl.load(req_row + offs_kv).to(tl.int64)
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, qpe, q_pos, offs_kv, rows, offs_kv < prefix_len, offs_n,
            K_buf_h, V_buf_h, stride_kbs, stride_vbs, offs_d, mask_d, offs_dpe, mask_dpe, offs_dv, mask_dv,
            sm_scale * k_scale, logit_cap, sliding_window, v_scale,
            BLOCK_DPE, False, False, USE_CAP, USE_WINDOW, V_SCALED, DOT_DTYPE, False, False)
    # (STAGE_V off: these tiles compile to warpgroup dots on sm90, which read fp8 V without byte loads)
    if full_hi < prefix_len:
        offs_kv = full_hi + offs_n
        mask_n = offs_kv < prefix_len
        rows = tl.load(req_row + offs_kv, mask=mask_n, other=0).to(tl.int64)
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, qpe, q_pos, offs_kv, rows, mask_n, offs_n,
            K_buf_h, V_buf_h, stride_kbs, stride_vbs, offs_d, mask_d, offs_dpe, mask_dpe, offs_dv, mask_dv,
            sm_scale * k_scale, logit_cap, sliding_window, v_scale,
            BLOCK_DPE, True, False, USE_CAP, USE_WINDOW, V_SCALED, DOT_DTYPE, False, False)

    # ---- the new tokens, causally (indices within the extend run), or through the request's tree mask ----
    K_ext_h = K_ext + cur_kv_head * stride_kh
    V_ext_h = V_ext + cur_kv_head * stride_vh
    hi = tl.minimum(ext_len, block_start + BLOCK_M)
    diag_lo = block_start
    left_hi = block_start  # the causal loops below run over [0, left_hi) unmasked and [diag_lo, hi) masked
    if TREE:
        # [ext_len, ext_len] row-major from the request's offset; ancestors come before a node, so keys < hi
        tree_row = Tree_mask + tl.load(Tree_start + cur_seq) + offs_m.to(tl.int64)[:, None] * ext_len
        for start_n in range(0, hi, BLOCK_N):
            offs_kv = start_n + offs_n
            in_tile = offs_kv < hi
            tree_vis = tl.load(tree_row + offs_kv[None, :], mask=mask_m[:, None] & in_tile[None, :], other=0) != 0
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, qpe, offs_m, offs_kv, (ext_start + offs_kv).to(tl.int64), in_tile, tree_vis,
                K_ext_h, V_ext_h, stride_kt, stride_vt, offs_d, mask_d, offs_dpe, mask_dpe, offs_dv, mask_dv,
                sm_scale, logit_cap, sliding_window, 1.0,
                BLOCK_DPE, True, False, USE_CAP, False, False, DOT_DTYPE, False, True)
        diag_lo = hi
        left_hi = 0
    if USE_WINDOW:
        diag_lo = tl.maximum(0, block_start - sliding_window + 1)
    else:
        # tiles left of this query block: every key is visible to every row (BLOCK_M % BLOCK_N == 0)
        for start_n in range(0, left_hi, BLOCK_N):
            offs_kv = start_n + offs_n
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, qpe, offs_m, offs_kv, (ext_start + offs_kv).to(tl.int64), offs_kv < hi, offs_n,
                K_ext_h, V_ext_h, stride_kt, stride_vt, offs_d, mask_d, offs_dpe, mask_dpe, offs_dv, mask_dv,
                sm_scale, logit_cap, sliding_window, 1.0,
                BLOCK_DPE, False, False, USE_CAP, USE_WINDOW, False, DOT_DTYPE, False, False)
    for start_n in range(diag_lo, hi, BLOCK_N):
        offs_kv = start_n + offs_n
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, qpe, offs_m, offs_kv, (ext_start + offs_kv).to(tl.int64), offs_kv < hi, offs_n,
            K_ext_h, V_ext_h, stride_kt, stride_vt, offs_d, mask_d, offs_dpe, mask_dpe, offs_dv, mask_dv,
            sm_scale, logit_cap, sliding_window, 1.0,
            BLOCK_DPE, True, True, USE_CAP, USE_WINDOW, False, DOT_DTYPE, False, False)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(O + q_rows[:, None] * stride_ot + cur_head * stride_oh + offs_dv[None, :],
             out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_dv[None, :])


# ---------------------------------------------------------------- host side

_TORCH_TO_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_dtype(q: torch.Tensor):
    """Operand dtype of the in-kernel dots.

    On CPU (TRITON_INTERPRET=1) the interpreter multiplies bf16 tiles as raw uint16, so dots run in fp32
    there; on the GPU they run in q's dtype (fp8 KV tiles are upcast to it exactly).
    """
    if q.dtype not in _TORCH_TO_TL:
        raise ValueError(f"attention queries must be float32, float16 or bfloat16, got {q.dtype}")
    if q.device.type != "cuda":
        return tl.float32
    return _TORCH_TO_TL[q.dtype]


def split_head_dim(d: int) -> tuple[int, int]:
    """Head dim -> (BLOCK_D, BLOCK_DPE): the largest power of two <= d plus a padded rest (0 if none).

    576 -> (512, 64), 192 -> (128, 64), 128 -> (128, 0). Dots need every dimension >= 16.
    """
    if d < 16:
        return 16, 0
    main = 1 << (d.bit_length() - 1)
    rest = d - main
    return main, (max(16, triton.next_power_of_2(rest)) if rest else 0)


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tuple(t.stride())}")


def launch_first_fitting(kernel, grid, configs: list[dict], key: tuple, *args, **kwargs) -> dict:
    """Launch `kernel` with the first of `configs` (block sizes, num_warps, num_stages) that fits the
    GPU's shared memory; remembers the choice under `key`. `grid` is a callable of the config."""
    first = _FITTING_CONFIG.get(key, 0)
    for i in range(first, len(configs)):
        cfg = configs[i]
        try:
            kernel[grid(cfg)](*args, **kwargs, **cfg)
        except OutOfResources:
            if i == len(configs) - 1:
                raise
            continue
        _FITTING_CONFIG[key] = i
        return cfg
    raise AssertionError("unreachable")


_FITTING_CONFIG: dict[tuple, int] = {}


def _cfg(block_m, block_n, num_warps, num_stages):
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)


def _extend_launch_configs(d: int, dv: int, device: torch.device, element_size: int = 2) -> list[dict]:
    """Preferred first; later entries need less shared memory (fp32 or split head dims). For 4-byte queries the
    list starts at the first config whose K/V stages and Q tile fit ~200 KB of shared memory: a block table (extend
    graphs) is cut in the first config's BLOCK_M and cannot fall back to a smaller one."""
    if device.type != "cuda":
        # interpreter: small tiles so tiny test shapes still cross several tiles
        return [_cfg(16, 16, 4, 1)]
    # measured on an H200 (bf16, Llama-3-8B and Gemma-2 head shapes, with and without cached prefixes)
    widest = max(d, dv)
    if widest <= 64:
        configs = [_cfg(128, 64, 4, 3), _cfg(64, 64, 4, 2), _cfg(32, 32, 4, 1)]
    elif widest <= 128:
        configs = [_cfg(128, 128, 8, 3), _cfg(128, 64, 8, 3), _cfg(64, 64, 4, 2), _cfg(32, 32, 4, 1)]
    elif widest <= 256:
        configs = [_cfg(128, 64, 8, 2), _cfg(64, 64, 4, 2), _cfg(32, 32, 4, 1)]
    else:  # MLA-style 576/512: a [BLOCK_M, 512] fp32 accumulator must stay in registers
        configs = [_cfg(32, 32, 8, 2), _cfg(32, 32, 4, 1), _cfg(16, 16, 4, 1)]
    if element_size > 2:
        def shared_bytes(c):
            return element_size * (c["num_stages"] * c["BLOCK_N"] * (d + dv) + c["BLOCK_M"] * d)

        fitting = [i for i, c in enumerate(configs) if shared_bytes(c) <= 200 * 1024]
        configs = configs[fitting[0]:] if fitting else configs[-1:]
    return configs


def extend_attention_fwd(
    q_extend: torch.Tensor,  # [T, H, D]
    k_extend: torch.Tensor,  # [T, Hkv, D]
    v_extend: torch.Tensor,  # [T, Hkv, Dv]
    o_extend: torch.Tensor,  # [T, H, Dv], written
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, Dv]
    req_to_token: torch.Tensor,  # [R, C] int32
    req_pool_indices: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B] prefix + extend (unused by the kernel; kept for a uniform signature)
    extend_seq_lens: torch.Tensor,  # [B]
    extend_start_loc: torch.Tensor,  # [B]
    prefix_lens: torch.Tensor,  # [B]
    max_len_extend: int,
    sm_scale: float,
    logit_cap: float = 0.0,
    sliding_window: int = -1,
    k_scale: float = 1.0,  # dequantisation scales of values read from k_buffer / v_buffer (fp8 caches)
    v_scale: float = 1.0,
    block_table: Optional[tuple[torch.Tensor, torch.Tensor]] = None,  # extend_block_table(...): fixed grid
    tree_mask: Optional[torch.Tensor] = None,  # [sum n_b^2] bool: request b's [n_b, n_b] mask over its new tokens
    tree_mask_start: Optional[torch.Tensor] = None,  # [B] int64: where request b's mask starts in tree_mask
) -> None:
    t, h, d = q_extend.shape
    h_kv = k_extend.shape[1]
    dv = v_extend.shape[-1]
    if h % h_kv:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({h_kv})")
    if k_extend.shape != (t, h_kv, d) or v_extend.shape != (t, h_kv, dv) or o_extend.shape != (t, h, dv):
        raise ValueError(f"inconsistent extend shapes: q {tuple(q_extend.shape)}, k {tuple(k_extend.shape)}, "
                         f"v {tuple(v_extend.shape)}, o {tuple(o_extend.shape)}")
    if k_buffer.shape[1:] != (h_kv, d) or v_buffer.shape[1:] != (h_kv, dv):
        raise ValueError(f"KV buffers {tuple(k_buffer.shape)} / {tuple(v_buffer.shape)} do not match "
                         f"Hkv={h_kv}, D={d}, Dv={dv}")
    check_last_dim_contiguous(q_extend=q_extend, k_extend=k_extend, v_extend=v_extend, o_extend=o_extend,
                              k_buffer=k_buffer, v_buffer=v_buffer, req_to_token=req_to_token)
    batch = req_pool_indices.shape[0]
    tree = tree_mask is not None
    if tree and (tree_mask_start is None or sliding_window > 0):
        raise ValueError("a tree mask needs tree_mask_start, and no sliding window (tree rows' positions are depths)")
    block_d, block_dpe = split_head_dim(d)
    configs = _extend_launch_configs(d, dv, q_extend.device, q_extend.element_size())
    if block_table is not None:
        block_seq, block_m = block_table
        # the table was cut in query blocks of extend_block_m's size: only configs of that size fit it
        configs = [c for c in configs if c["BLOCK_M"] == configs[0]["BLOCK_M"]]
        grid = lambda cfg: (block_seq.shape[0], h)  # noqa: E731
    else:
        if batch == 0 or max_len_extend <= 0 or t == 0:
            return
        block_seq = block_m = extend_seq_lens  # unread placeholders
        grid = lambda cfg: (batch, h, triton.cdiv(max_len_extend, cfg["BLOCK_M"]))  # noqa: E731
    key = ("extend", q_extend.device, q_extend.dtype, k_extend.dtype, k_buffer.dtype, d, dv, block_table is not None,
           tree)
    launch_first_fitting(
        _extend_fwd_kernel, grid, configs, key,
        q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, req_to_token,
        req_pool_indices, extend_start_loc, extend_seq_lens, prefix_lens, block_seq, block_m,
        tree_mask if tree else extend_seq_lens, tree_mask_start if tree else extend_seq_lens,  # placeholders: unread
        float(sm_scale), float(logit_cap), int(sliding_window), float(k_scale), float(v_scale),
        q_extend.stride(0), q_extend.stride(1), k_extend.stride(0), k_extend.stride(1),
        v_extend.stride(0), v_extend.stride(1), o_extend.stride(0), o_extend.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        KV_GROUP=h // h_kv, D=d, DV=dv,
        BLOCK_D=block_d, BLOCK_DPE=block_dpe, BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        USE_CAP=logit_cap > 0, USE_WINDOW=sliding_window > 0, V_SCALED=v_scale != 1.0,
        DOT_DTYPE=dot_dtype(q_extend), BLOCK_TABLE=block_table is not None, TREE=tree,
    )


def extend_block_m(d: int, dv: int, device: torch.device, dtype: torch.dtype) -> int:
    """The query-block size of extend programs launched through a block table, for head dims d / dv and queries of
    `dtype`."""
    return _extend_launch_configs(d, dv, device, dtype.itemsize)[0]["BLOCK_M"]


def extend_block_table(extend_seq_lens: torch.Tensor, block_m: int, num_entries: int,
                       out: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, query block) of each of num_entries programs, on the device without a host sync (so it can be
    captured in a CUDA graph): the requests' blocks of block_m new tokens in order, then -1 / 0 for the entries past
    them. num_entries >= cdiv(tokens, block_m) + requests covers any split of the tokens. Returns int32 [num_entries]
    pairs, written into `out` when given."""
    blocks = (extend_seq_lens.to(torch.int64) + block_m - 1) // block_m  # [B]
    ends = torch.cumsum(blocks, 0)  # [B]
    entry = torch.arange(num_entries, device=extend_seq_lens.device)
    seq = torch.searchsorted(ends, entry, right=True)  # [E] in 0..B
    inside = seq < extend_seq_lens.shape[0]
    seq = seq.clamp_(max=max(extend_seq_lens.shape[0] - 1, 0))
    block = entry - (ends - blocks)[seq]
    seq = torch.where(inside, seq, -1)
    block = torch.where(inside, block, 0)
    if out is None:
        return seq.to(torch.int32), block.to(torch.int32)
    out[0].copy_(seq)
    out[1].copy_(block)
    return out
