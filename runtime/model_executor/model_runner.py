"""ModelRunner: loads the model, owns the KV pools and the attention backend, runs one forward pass."""

from __future__ import annotations

import logging

import torch

from braid.runtime.config import DEFAULT_MAX_RUNNING_REQUESTS, ServerArgs
from braid.runtime.core import ForwardBatch, ForwardOutput
from braid.runtime.distributed import parallel_state as ps
from braid.runtime.layers.argmax_kernels import argmax_last_dim
from braid.runtime.layers.attention.registry import check_backend_device, default_backend, get_backend_class
from braid.runtime.dtypes import kv_cache_dtype, model_dtype
from braid.runtime.layers.kernel_switches import apply_kernel_switches
from braid.runtime.layers.logits import compute_logits, last_token_rows, token_logprobs
from braid.runtime.layers.sampler import Sampler, apply_penalties
from braid.runtime.loader import load_model_config
from braid.runtime.model_executor.model_loader import load_model
from braid.runtime.mem_cache.kv_sizing import (check_kv_pool_fits, hybrid_tokens_for_budget, max_tokens_for_budget,
                                               mha_kv_bytes_per_token, mla_kv_bytes_per_token, window_tokens_for)
from braid.runtime.mem_cache.window_pool import HybridKVPool, window_layer_split
from braid.runtime.mem_cache.pools import MHAKVPool, MLAKVPool, ReqToTokenPool

logger = logging.getLogger(__name__)

# Extend passes graphed by default up to this many tokens. On the H200 (Llama-3-8B-shaped, ShareGPT at 16 req/s, whose
# extends hold ~175 tokens) graphs up to 4096 tokens cut mean TPOT 8.3 -> 6.4 ms; with 3000 requests at once (extends
# of ~2,000 tokens, GPU-bound, their launch hidden) they gave 10,846 against 11,692 output tok/s eager, so the larger
# extends stay eager.
DEFAULT_CUDA_GRAPH_MAX_EXTEND_TOKENS = 1024
_CPU_DEFAULT_KV_TOKENS = 65536  # the most a CPU pool gets by default, and the figure where MemAvailable is unknown
_CPU_MIN_KV_TOKENS = 4096
_CPU_KV_MEMORY_FRACTION = 0.10


def cpu_default_kv_tokens(mem_available_bytes, bytes_per_token: int) -> int:
    """The CPU KV pool's default size: a tenth of the available memory, within [4096, 65536] tokens."""
    if mem_available_bytes is None:
        return _CPU_DEFAULT_KV_TOKENS
    fitting = int(mem_available_bytes * _CPU_KV_MEMORY_FRACTION) // bytes_per_token
    return max(_CPU_MIN_KV_TOKENS, min(_CPU_DEFAULT_KV_TOKENS, fitting))


def _mem_available_bytes():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the figure is in kB
    except (OSError, ValueError, IndexError):
        pass
    return None


class ModelRunner:
    def __init__(self, server_args: ServerArgs):
        self.server_args = server_args
        self.device = torch.device(server_args.resolved_device)
        self.attn_backend_name = server_args.attention_backend or default_backend(self.device.type)
        check_backend_device(self.attn_backend_name, self.device.type)  # before minutes of loading, not after
        apply_kernel_switches(server_args)
        self.model_config = load_model_config(server_args)
        self.dtype = model_dtype(server_args.dtype, self.device.type)
        torch.manual_seed(server_args.random_seed)
        self.model = load_model(self.model_config, server_args, self.device, self.dtype)
        self.lora_manager = None
        if server_args.enable_lora:
            from braid.runtime.lora.manager import LoraManager

            if self.model_config.is_multimodal:
                raise ValueError("--enable-lora on a vision model is not supported yet")
            self.lora_manager = LoraManager(self.model, server_args, self.device, self.dtype)
        self.vocab_size = self.model_config.vocab_size
        self.context_len = self.model_config.context_len
        self._init_pools()
        self.attn_backend = get_backend_class(self.attn_backend_name)(self)
        self.sampler = Sampler()
        self.cuda_graph_runner = None
        self.extend_graph_runner = None
        self._graphs_after_calibration = False
        if server_args.calculate_kv_scales:
            self.kv_pool.calibrate_kv_scales_on_next_store()
        if self.device.type == "cuda" and self.attn_backend_name == "torch":
            logger.info("CUDA graphs off: the torch attention backend cannot be captured")
        if self.device.type == "cuda" and not server_args.disable_cuda_graph:
            if server_args.calculate_kv_scales:
                # the captured kernels would keep the scales of capture time
                self._graphs_after_calibration = True
                logger.info("CUDA graphs: captured after the first prefill batch sets the KV scales "
                            "(--calculate-kv-scales)")
            else:
                self._capture_cuda_graphs()

    def _capture_cuda_graphs(self) -> None:
        from braid.runtime.model_executor.cuda_graph import CudaGraphRunner, ExtendCudaGraphRunner

        self.cuda_graph_runner = CudaGraphRunner(self)
        asked = self.server_args.cuda_graph_max_extend_tokens
        if asked == 0:
            return
        why_not = self.extend_graphs_unsupported()
        if not why_not:
            self.extend_graph_runner = ExtendCudaGraphRunner(
                self, max_tokens=asked or DEFAULT_CUDA_GRAPH_MAX_EXTEND_TOKENS)
        elif asked is not None:
            logger.warning("extend passes run eagerly: %s (--cuda-graph-max-extend-tokens)", why_not)

    def extend_graphs_unsupported(self) -> str:
        """Why extend passes of this model and backend are not captured ('' when they are)."""
        if not self.attn_backend.supports_extend_cuda_graph:
            return f"the {self.attn_backend_name} attention backend cannot capture them"
        return ""

    # ---- memory ----
    def _init_pools(self) -> None:
        mc = self.model_config
        kv_dtype = kv_cache_dtype(self.server_args.kv_cache_dtype, self.dtype)
        heads_kv = ps.split_units(mc.num_key_value_heads, "KV heads")[1]  # this TP rank's (replicated when fewer)
        per_token = self._kv_bytes_per_token(kv_dtype)
        # window layers' KV trimmed (mem_cache/window_pool.py) when the layers mix windows and global attention
        layer_windows = [spec.sliding_window for spec in mc.layers]
        hybrid = (mc.attention_arch != "mla" and not self.server_args.disable_window_kv_trimming
                  and window_layer_split(layer_windows) is not None)
        self.window_kv_tokens = None
        total = self.server_args.max_total_tokens
        requested = total is not None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # blocks the loader freed and the allocator still caches are the pool's too
            free, capacity = torch.cuda.mem_get_info(self.device)
            budget = free - capacity * (1 - self.server_args.mem_fraction_static)
        if total is None:
            if self.device.type == "cuda":
                total = max(int(budget // per_token), 1024)
                if hybrid:
                    total, self.window_kv_tokens = self._hybrid_sizes(budget, layer_windows, kv_dtype)
            else:
                available = _mem_available_bytes()
                total = cpu_default_kv_tokens(available, per_token)
                logger.info("CPU KV pool default: %.0f%% of %s available memory, within %d..%d tokens "
                            "(--max-total-tokens sets it)", _CPU_KV_MEMORY_FRACTION * 100,
                            "unknown" if available is None else f"{available / 2**30:.1f} GiB",
                            _CPU_MIN_KV_TOKENS, _CPU_DEFAULT_KV_TOKENS)
        self.max_total_tokens = ps.min_over_ranks(int(total))  # TP ranks schedule against one budget
        self.max_running_requests = self.server_args.running_requests_cap(self.max_total_tokens)
        max_reqs = min(self.max_running_requests + 32, max(self.max_total_tokens // 2, 8))
        if hybrid:
            if self.window_kv_tokens is None:
                self.window_kv_tokens = window_tokens_for(self.max_total_tokens, max(w for w in layer_windows if w),
                                                          self.context_len, self._extend_tokens_bound(),
                                                          self.server_args.window_kv_ratio)
            self.window_kv_tokens = ps.min_over_ranks(self.window_kv_tokens)
        if self.device.type == "cuda":
            # an asked-for size must leave the mem-fraction reserve; the runtime's own smallest pool only has to fit
            self._check_pool_fits(kv_dtype, layer_windows if hybrid else None, free, capacity,
                                  capacity * (1 - self.server_args.mem_fraction_static) if requested else 0, requested)
        self.req_to_token_pool = ReqToTokenPool(max_reqs, self.context_len + 8, self.device)
        if hybrid:
            k_scales, v_scales = getattr(self.model, "kv_cache_scales", None) or (1.0, 1.0)
            self.kv_pool = HybridKVPool(
                self.max_total_tokens, self.window_kv_tokens, self.dtype, heads_kv, mc.head_dim, layer_windows,
                self.device, v_head_dim=mc.v_head_dim, kv_cache_dtype=kv_dtype, k_scale=k_scales, v_scale=v_scales)
            logger.info("KV pool: window layers' KV trimmed to %d token slots beside %d for the global layers "
                        "(--disable-window-kv-trimming keeps one pool)", self.window_kv_tokens, self.max_total_tokens)
        elif mc.attention_arch == "mla":
            self.kv_pool = MLAKVPool(self.max_total_tokens, self.dtype, mc.kv_lora_rank, mc.qk_rope_head_dim,
                                     mc.num_layers, self.device, kv_cache_dtype=kv_dtype)
        else:
            # an fp8_e4m3 cache takes the checkpoint's per-layer KV scales when it has them (loader), else 1.0
            k_scales, v_scales = getattr(self.model, "kv_cache_scales", None) or (1.0, 1.0)
            self.kv_pool = MHAKVPool(self.max_total_tokens, self.dtype, heads_kv, mc.head_dim, mc.num_layers,
                                     self.device, v_head_dim=mc.v_head_dim, kv_cache_dtype=kv_dtype,
                                     k_scale=k_scales, v_scale=v_scales)
        logger.info("KV pool: %d tokens (%.1f MiB), %d request slots", self.max_total_tokens,
                    self.max_total_tokens * per_token / 2**20, max_reqs)

    def _extend_tokens_bound(self) -> int:
        """The most new tokens one forward pass allocates: a prefill batch's budget plus mixed-in decode tokens."""
        sa = self.server_args
        chunk = self.context_len if sa.chunked_prefill_size == -1 else sa.chunked_prefill_size
        # the pool is not sized yet when this is first asked: an unset max_running_requests counts as its largest
        # derived value (ServerArgs.running_requests_cap)
        cap = sa.max_running_requests or max(DEFAULT_MAX_RUNNING_REQUESTS, sa.cuda_graph_max_bs)
        return min(sa.max_prefill_tokens, chunk) + cap

    def _kv_bytes_per_token(self, kv_dtype) -> int:
        """One token's KV over all layers in this rank's pool layout (MLA's latent, or per-head K and V)."""
        mc = self.model_config
        if mc.attention_arch == "mla":
            return mla_kv_bytes_per_token(mc.kv_lora_rank, mc.qk_rope_head_dim, mc.num_layers, kv_dtype)
        heads_kv = ps.split_units(mc.num_key_value_heads, "KV heads")[1]
        return mha_kv_bytes_per_token(heads_kv, mc.head_dim, mc.num_layers, kv_dtype, mc.v_head_dim)

    def _hybrid_bytes_per_token(self, layer_windows: list, kv_dtype) -> tuple[int, int]:
        """A hybrid pool's KV bytes a token: (global layers' space, window layers' space)."""
        mc = self.model_config
        num_window = sum(1 for w in layer_windows if w)
        per_layer = mha_kv_bytes_per_token(ps.split_units(mc.num_key_value_heads, "KV heads")[1], mc.head_dim, 1,
                                           kv_dtype, mc.v_head_dim)
        return per_layer * (len(layer_windows) - num_window), per_layer * num_window

    def _hybrid_sizes(self, budget: float, layer_windows: list, kv_dtype) -> tuple[int, int]:
        full_bytes, window_bytes = self._hybrid_bytes_per_token(layer_windows, kv_dtype)
        full, window = hybrid_tokens_for_budget(int(budget), full_bytes, window_bytes,
                                                max(w for w in layer_windows if w), self.context_len,
                                                self._extend_tokens_bound(), self.server_args.window_kv_ratio)
        return max(full, 1024), max(window, 1024)

    def _check_pool_fits(self, kv_dtype, layer_windows, free: int, capacity: int, reserved: float,
                         requested: bool) -> None:
        """Refuses (KVPoolTooLarge) the pool _init_pools settled on (max_total_tokens, window_kv_tokens) when the
        device cannot hold it, before any of it is allocated. layer_windows: a hybrid pool's (None for one space);
        free, capacity: torch.cuda.mem_get_info after the weights; reserved: bytes the pool must leave free."""
        mc = self.model_config
        per_token = self._kv_bytes_per_token(kv_dtype)
        tokens, available = self.max_total_tokens, int(free - reserved)
        if layer_windows is None:
            pool_bytes = (tokens + 1) * per_token  # + the dummy slot
            fitting = max_tokens_for_budget(max(available, 0), per_token)
        else:
            full_bytes, window_bytes = self._hybrid_bytes_per_token(layer_windows, kv_dtype)
            pool_bytes = (tokens + 1) * full_bytes + (self.window_kv_tokens + 1) * window_bytes
            fitting = 0 if available <= 0 else hybrid_tokens_for_budget(
                available, full_bytes, window_bytes, max(w for w in layer_windows if w), self.context_len,
                self._extend_tokens_bound(), self.server_args.window_kv_ratio)[0]
        latent = (mla_kv_bytes_per_token(mc.mla.kv_lora_rank, mc.mla.qk_rope_head_dim, mc.num_layers, kv_dtype)
                  if mc.mla_expanded else None)
        check_kv_pool_fits(tokens, pool_bytes, per_token, int(free), int(reserved), fitting, device=str(self.device),
                           requested=requested, mem_fraction_static=self.server_args.mem_fraction_static,
                           capacity_bytes=int(capacity), kv_dtype=kv_dtype, latent_bytes_per_token=latent,
                           heads_split_by_tp=mc.attention_arch == "mha"
                           and ps.split_units(mc.num_key_value_heads, "KV heads")[1] > 1)

    # ---- forward ----
    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> ForwardOutput:
        """One pass: the model, the logits at each request's last token, then on the device penalties, the vocab
        mask and sampling (greedy when fb.sampling_info is None), and the logprobs asked for; with
        fb.defer_sampling, the logits alone (ForwardOutput.pending_logits, for `sample`)."""
        hidden = self.forward_hidden(fb)
        logits = compute_logits(self.model.lm_head, hidden, last_token_rows(fb), self.vocab_size)  # [B, V] fp32
        if fb.defer_sampling:
            return ForwardOutput(next_token_ids=None, pending_logits=logits)
        out = self.sample(logits, fb.sampling_info)
        if fb.capture_hidden:
            out.hidden_states, out.aux_hidden_states = hidden, fb.aux_hidden
        if fb.logits_indices is not None and fb.logits_indices.numel():
            info = fb.sampling_info
            prompt_logits = compute_logits(self.model.lm_head, hidden, fb.logits_indices, self.vocab_size)
            top_k = (info.logprob_top_k or 0) if info is not None else 0
            out.input_token_logprobs, out.input_top_logprobs, out.input_top_ids = token_logprobs(
                prompt_logits, fb.logits_targets, top_k)
        return out

    @torch.inference_mode()
    def forward_hidden(self, fb: ForwardBatch) -> torch.Tensor:
        """The model's pass alone (a captured graph when one fits): final hidden states [T, hidden] for every token,
        which speculative verification turns into logits at every position. With fb.aux_hidden_layers (EAGLE-3) the
        pass runs eagerly and the model fills fb.aux_hidden."""
        if self._graphs_after_calibration and not self.kv_pool.calibrating_kv_scales:
            self._graphs_after_calibration = False
            with torch.inference_mode(False):  # static buffers as at start-up: normal tensors
                self._capture_cuda_graphs()
        fb.req_to_token_pool = self.req_to_token_pool
        fb.kv_pool = self.kv_pool
        fb.attn_backend = self.attn_backend
        graphs = fb.aux_hidden_layers is None
        if (graphs and fb.forward_mode.is_decode() and self.cuda_graph_runner is not None
                and self.cuda_graph_runner.can_run(fb)):
            return self.cuda_graph_runner.replay(fb)
        if graphs and self.extend_graph_runner is not None and self.extend_graph_runner.can_run(fb):
            return self.extend_graph_runner.replay(fb)
        self.attn_backend.init_forward_metadata(fb)
        if self.lora_manager is not None:
            self.lora_manager.prepare(fb)
        elif fb.lora_paths is not None:
            raise ValueError("a request names a LoRA adapter but the server runs without --enable-lora")
        return self.model(fb)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, info) -> ForwardOutput:
        """logits: [B, V] fp32 -> the sampled ids (penalties and the vocab mask applied on the device; greedy when
        info is None) and the logprobs asked for. A pass run with fb.defer_sampling comes here later with its
        ForwardOutput.pending_logits, once the host knows what the mask needs."""
        if info is None:
            return ForwardOutput(next_token_ids=argmax_last_dim(logits))
        if info.fill_token_bitmask is not None:
            info.token_bitmask, info.fill_token_bitmask = info.fill_token_bitmask(), None
        out = ForwardOutput(next_token_ids=self.sampler(apply_penalties(logits, info), info))
        # TP: every rank holds the same logits; rank 0's draw is the one all ranks commit
        ps.broadcast_from_first(out.next_token_ids)
        if info.logprob_top_k is not None:
            out.next_token_logprobs, out.next_top_logprobs, out.next_top_ids = token_logprobs(
                logits, out.next_token_ids, info.logprob_top_k)
        return out
