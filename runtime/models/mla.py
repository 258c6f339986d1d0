"""Multi-head latent attention (DeepSeek-V2): keys and values are compressed into one latent per token.

Per token: q = q_b(norm(q_a(x))) (or q_proj(x) without q_lora), latent = norm(kv_a(x)[:R]) and one rope key
k_pe = kv_a(x)[R:] shared by all heads. Expanded, head h's key is [W_uk[h] latent ; k_pe] and its value
W_uv[h] latent (kv_b_proj holds W_uk and W_uv). Absorbed (the default), W_uk moves into the query
(q_nope[h] W_uk[h]) and W_uv after the attention, so every head attends over the same cached row
[latent ; k_pe]: MQA with one KV head, Dk = R + rope, Dv = R, and the cache holds only that row.
`--disable-mla` (ModelConfig.mla_expanded) runs the expanded form over a per-head MHA cache instead.
"""

from __future__ import annotations

import torch
from torch import nn

from braid.runtime.distributed import parallel_state as ps
from braid.runtime.layers.linear import ColumnParallelLinear, RowParallelLinear
from braid.runtime.layers.mla_kernels import dequantized_head_weight, latent_to_head_values
from braid.runtime.layers.norm import RMSNorm
from braid.runtime.layers.radix_attention import RadixAttention
from braid.runtime.layers.rotary import RotaryEmbedding
from braid.runtime.loader.config_specs import LayerSpec, MLASpec

# (fused param, HF name, shard) rows for CausalLM.load_weights: the projections that read the layer input
MLA_STACKED_PARAMS = [("qkv_proj", "q_a_proj", 0), ("qkv_proj", "q_proj", 0), ("qkv_proj", "kv_a_proj_with_mqa", 1)]


class MLAttention(nn.Module):
    """One MLA layer. `qkv_proj` fuses the two projections of the layer input (q_a_proj or q_proj, and
    kv_a_proj_with_mqa) so that the pre-attention norm travels with one matmul (norm_linear_act)."""

    def __init__(self, layer_id: int, spec: LayerSpec, mla: MLASpec, rotary: RotaryEmbedding, hidden_size: int,
                 rms_norm_eps: float, absorbed: bool, bias: bool = False):
        super().__init__()
        if spec.attention != "mla":
            raise ValueError(f"layer {layer_id} is {spec.attention!r} attention; this block builds 'mla' layers")
        # TP: the heads split over the ranks (q_b/q_proj, kv_b and o_proj by head); the latent and the rope key are
        # every head's, so each rank computes and caches them whole
        head_first, self.num_heads = ps.split_units(spec.num_heads, f"layer {layer_id}'s attention heads")
        self.kv_lora_rank = mla.kv_lora_rank
        self.nope_dim = mla.qk_nope_head_dim
        self.rope_dim = mla.qk_rope_head_dim
        self.v_head_dim = mla.v_head_dim
        self.absorbed = absorbed
        qk_dim = self.nope_dim + self.rope_dim
        self.q_lora_rank = mla.q_lora_rank
        # the q part of qkv_proj: the q latent (q_lora) or q itself
        self.q_in = mla.q_lora_rank or self.num_heads * qk_dim
        q_range = (0, mla.q_lora_rank) if mla.q_lora_rank else (head_first * qk_dim, self.q_in)
        # q_proj has no bias in DeepSeek's checkpoints, q_a_proj and kv_a_proj_with_mqa have one with attention_bias
        if bias and not mla.q_lora_rank:
            raise ValueError("attention_bias without q_lora_rank is not supported (q_proj has no bias)")
        self.qkv_proj = ColumnParallelLinear(hidden_size, [mla.q_lora_rank or spec.num_heads * qk_dim,
                                                           self.kv_lora_rank + self.rope_dim], bias=bias,
                                             shard_ranges=[q_range, (0, self.kv_lora_rank + self.rope_dim)])
        if mla.q_lora_rank:
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, [spec.num_heads * qk_dim],
                                                 shard_ranges=[(head_first * qk_dim, self.num_heads * qk_dim)])
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, rms_norm_eps)
        # [H * (nope + v), R]; absorbed, it becomes w_kc / w_vc in absorb_weights and is dropped
        kv_b_head = self.nope_dim + self.v_head_dim
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, [spec.num_heads * kv_b_head],
                                              shard_ranges=[(head_first * kv_b_head, self.num_heads * kv_b_head)])
        self.o_proj = RowParallelLinear(spec.num_heads * self.v_head_dim, hidden_size, bias=bias,
                                        shard_range=(head_first * self.v_head_dim, self.num_heads * self.v_head_dim))
        self.rotary_emb = rotary
        self.w_kc = None  # [H, nope, R]: q_nope -> the latent query
        self.w_vc = None  # [H, v, R]: latent output -> the head's value output (rows of R: a GEMV streams them)
        # an fp8 kv_b_proj (checkpoint or --quantization fp8): w_kc / w_vc stay e4m3, with these fp32 per-row scales
        self.w_kc_scale = None  # [H, nope]
        self.w_vc_scale = None  # [H, v]
        if absorbed:
            self.attn = RadixAttention(layer_id, self.num_heads, self.kv_lora_rank + self.rope_dim, 1,
                                       scaling=spec.scaling, v_head_dim=self.kv_lora_rank)
        else:
            self.attn = RadixAttention(layer_id, self.num_heads, qk_dim, self.num_heads, scaling=spec.scaling,
                                       v_head_dim=self.v_head_dim)

    @torch.no_grad()
    def absorb_weights(self) -> None:
        """After loading: split kv_b_proj into the per-head absorbed matrices (absorbed mode only)."""
        if not self.absorbed or self.kv_b_proj is None:
            return
        if self.kv_b_proj.weight.is_meta:
            raise ValueError("weights missing from the checkpoint: self_attn.kv_b_proj.weight")
        w = self.kv_b_proj.weight
        rows = self.nope_dim + self.v_head_dim
        w = w.view(self.num_heads, rows, self.kv_lora_rank)
        self.w_kc = w[:, : self.nope_dim].contiguous()  # [H, nope, R]
        self.w_vc = w[:, self.nope_dim:].contiguous()  # [H, v, R]
        scale = getattr(self.kv_b_proj, "weight_scale", None)
        if scale is not None and w.dtype.itemsize == 1:  # an fp8 layer: one scale per row (a tensor's, repeated)
            scale = scale.float().reshape(-1).expand(self.num_heads * rows).reshape(self.num_heads, rows)
            self.w_kc_scale = scale[:, : self.nope_dim].contiguous()
            self.w_vc_scale = scale[:, self.nope_dim:].contiguous()
        self.kv_b_proj = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden), fb)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, fb) -> torch.Tensor:
        # qkv: [T, q_in + R + rope], the qkv_proj output -> [T, hidden]
        T, H = qkv.shape[0], self.num_heads
        q, latent, k_pe = qkv.split([self.q_in, self.kv_lora_rank, self.rope_dim], dim=-1)
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_pe = q.view(T, H, self.nope_dim + self.rope_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        if self.absorbed:
            if fb.forward_mode.is_decode():
                # the pool writes the cache rows [norm(latent) ; rot(k_pe)] and builds [q_nope w_kc ; rot(q_pe)] (one
                # launch on CUDA); attention then reads the keys and values from the pool
                q_full = _store_latent_and_build_query(
                    fb.kv_pool, self.attn.layer_id, fb.out_cache_loc, positions, latent, k_pe,
                    self.kv_a_layernorm, self.rotary_emb, q_nope, self.w_kc, q_pe, self.w_kc_scale)  # [T, H, R + rope]
                return self._absorbed_output(self.attn(q_full.view(T, -1), None, None, fb, save_kv_cache=False))
            w_kc = dequantized_head_weight(self.w_kc, self.w_kc_scale, q_nope.dtype)
            q_latent = torch.bmm(q_nope.transpose(0, 1), w_kc)  # [H, T, R]
        latent = self.kv_a_layernorm(latent)  # [T, R]
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)  # [T, H * rope], [T, rope]
        q_pe = q_pe.view(T, H, self.rope_dim)
        if self.absorbed:
            q_full = torch.cat([q_latent.transpose(0, 1), q_pe], dim=-1)  # [T, H, R + rope]
            k_full = torch.cat([latent, k_pe], dim=-1)  # [T, R + rope]
            return self._absorbed_output(self.attn(q_full.view(T, -1), k_full, latent, fb))
        kv = self.kv_b_proj(latent).view(T, H, self.nope_dim + self.v_head_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.view(T, 1, self.rope_dim).expand(T, H, self.rope_dim)], dim=-1)
        q_full = torch.cat([q_nope, q_pe], dim=-1)
        out = self.attn(q_full.view(T, -1), k.view(T, -1), v.reshape(T, -1), fb)  # [T, H * v]
        return self.o_proj(out)

    def _absorbed_output(self, out: torch.Tensor) -> torch.Tensor:
        # out: [T, H * R], attention over the latent -> each head's value output via w_vc -> o_proj -> [T, hidden]
        T, H = out.shape[0], self.num_heads
        return self.o_proj(latent_to_head_values(out.view(T, H, self.kv_lora_rank), self.w_vc,
                                                 self.w_vc_scale))  # via [T, H * v]


@torch.compiler.disable
def _store_latent_and_build_query(pool, *args) -> torch.Tensor:
    # under torch.compile the pool's cache write (and its Triton launch) stays outside the graph, as attention does
    return pool.store_latent_and_build_query(*args)
