"""ServerArgs: every knob of the runtime, one frozen dataclass; the CLI is generated from its fields."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Optional


def _opt(default, help: str, choices=None, aliases: tuple = ()):
    return field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases})


# other projects' spellings of a value -> ours (`--dtype half` is vLLM's and SGLang's float16; vLLM's
# `--kv-cache-dtype fp8` is e4m3; SGLang's `--attention-backend torch_native` is our torch)
VALUE_ALIASES = {"dtype": {"half": "float16", "float": "float32"}, "kv_cache_dtype": {"fp8": "fp8_e4m3"},
                 "attention_backend": {"torch_native": "torch"}}

# max_running_requests when unset: one request per this many KV pool tokens, at least the default and at most the
# larger of the default and the largest CUDA-graph batch (on the H200, ShareGPT 3000 at once: a pool-derived cap of
# 3300 gave 8,447 output tok/s against 10,019 at 256 with graphs to 256, batches past the graphs decoding eagerly;
# 512 graphed with 4 continuous decode steps 13,161 against 11,271 at 256; random 1k/256 5,785 against 5,751)
DEFAULT_MAX_RUNNING_REQUESTS = 256
KV_TOKENS_PER_DERIVED_REQUEST = 256
# num_continuous_decode_steps when unset on CUDA (H200, Llama-3-8B dummy: ShareGPT 3000 at once 9,136 -> 10,166
# output tok/s with 4; random 1000 x 1024/256 5,780 -> 5,846; 8 lost 5%); 1 elsewhere (a CPU step is slow to wait on)
DEFAULT_CUDA_CONTINUOUS_DECODE_STEPS = 4
# With it unset on CUDA, admission after those steps also waits (up to DEFAULT_CUDA_MAX_CONTINUOUS_DECODE_STEPS) until
# the free running slots would take DEFAULT_CUDA_ADMISSION_MIN_EXTEND_TOKENS prompt tokens: an eager extend pass of an
# 8B model costs ~25-50 ms of kernel launches on the H200's host, more than the GPU time of ~1,000 tokens. ShareGPT
# 3000 (145-token prompts, extends of ~1,060 tokens every 4 steps): 8 steps 14,635 output tok/s (212 extends) vs 4
# steps 13,643 (407 extends); random 1k (768-token prompts: the slots freed in 4 steps hold ~8k tokens) is paced
# by the 4 steps, where 8 gave 5,319 vs 5,785 (separate calls).
DEFAULT_CUDA_MAX_CONTINUOUS_DECODE_STEPS = 8
DEFAULT_CUDA_ADMISSION_MIN_EXTEND_TOKENS = 2048


# the projections a LoRA adapter may target (runtime/lora/adapter.py maps them onto braid's fused linears)
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_lora_paths(entries) -> dict[str, str]:
    """--lora-paths entries 'name=path' (or a bare path, named by its folder) -> {name: path}."""
    out: dict[str, str] = {}
    for entry in entries or ():
        name, sep, path = entry.partition("=")
        if not sep:
            path = entry
            name = path.rstrip("/").rsplit("/", 1)[-1]
        if not name or not path:
            raise ValueError(f"--lora-paths entry {entry!r} is not name=path")
        if ":" in name:
            raise ValueError(f"--lora-paths name {name!r} may not contain ':' (OpenAI 'model' names adapters as "
                             "'base:name')")
        if name in out:
            raise ValueError(f"--lora-paths names adapter {name!r} twice")
        out[name] = path
    return out



@dataclass(frozen=True)
class ServerArgs:
    # ---- model ----
    model_path: str = _opt("smollm2", "HF folder, .gguf file, or 'smollm2' (the embedded SmolLM2-135M-Instruct); "
                                      "also positional: braid serve MODEL", aliases=("--model",))
    tokenizer_path: Optional[str] = _opt(None, "tokenizer folder/file; defaults to the model's")
    load_format: str = _opt("auto", "weight format", ["auto", "safetensors", "gguf", "dummy"])
    model_config: Optional[str] = _opt(None, "config.json (path or inline JSON) for --load-format dummy; overrides "
                                             "the model's config", aliases=("--json-model-override-args",))
    dtype: str = _opt("auto", "weights and activations dtype (auto: bf16 on GPU, fp32 on CPU; half = float16, "
                              "float = float32)",
                      ["auto", "float32", "bfloat16", "float16"])
    kv_cache_dtype: str = _opt("auto", "KV cache dtype (auto: the model's; fp8_e5m2 stores values as they are, "
                                       "fp8_e4m3 divided by per-layer scales: the checkpoint's k_scale/v_scale, "
                                       "else 1.0)",
                               ["auto", "float32", "bfloat16", "float16", "fp8_e5m2", "fp8_e4m3"])
    calculate_kv_scales: bool = _opt(False, "with --kv-cache-dtype fp8_e4m3: set each layer's k/v scales from the "
                                            "first prefill batch (its largest |k|, |v| stored at an eighth of "
                                            "e4m3's range) instead of the checkpoint's or 1.0; on CUDA the graphs are "
                                            "captured after that batch")
    quantization: Optional[str] = _opt(None, "linear layers' weights: fp8 = e4m3 with per-channel scales (a dense "
                                             "checkpoint is quantized at load; an FP8 checkpoint is read as it is "
                                             "without this flag too); embedding and LM head stay in --dtype",
                                       ["fp8"])
    device: str = _opt("auto", "cpu, cuda or auto", ["auto", "cpu", "cuda"])
    context_length: Optional[int] = _opt(None, "override the model's context length")
    trust_remote_code: bool = _opt(False, "accepted for compatibility; has no effect (braid never runs code from a "
                                          "model folder)")
    served_model_name: Optional[str] = _opt(None, "model name reported by the API (default: the model folder's or "
                                                  "file's name)")
    chat_template: Optional[str] = _opt(None, "chat template used by the chat routes instead of the tokenizer's: a "
                                              "name (chatml, qwen, llama-3-instruct, gemma-it), a Jinja file, or "
                                              "the template text")
    chat_template_content_format: str = _opt("auto", "how the chat template gets a message's content: openai = the "
                                                     "list of parts ({'type': 'text', 'text'}, {'type': 'image'}, "
                                                     "{'type': 'video'}), for templates that iterate over them; "
                                                     "string = one text with <image> / <video> where the media "
                                                     "were; auto = openai when the template loops over a message's "
                                                     "content, else string", ["auto", "string", "openai"])
    random_seed: int = _opt(0, "seed for dummy weights and unseeded sampling")

    # ---- memory and scheduling ----
    max_total_tokens: Optional[int] = _opt(None, "KV pool size in tokens (default: from mem_fraction_static on GPU; on CPU "
                                                      "10% of available memory, 4096..65536 tokens)")
    mem_fraction_static: float = _opt(0.85, "fraction of GPU memory for weights + KV pool")
    max_running_requests: Optional[int] = _opt(None, "max requests decoding at once (default: one per 256 "
                                                     "KV pool tokens, within 256..max(256, --cuda-graph-max-bs), so "
                                                     "512 for a large GPU pool; 256 with --max-queued-requests)")
    max_prefill_tokens: int = _opt(16384, "max new tokens in one extend batch")
    chunked_prefill_size: int = _opt(4096, "split prompts longer than this over several extend steps (-1: off)")
    schedule_policy: str = _opt("lpm", "waiting-queue order: lpm (longest cached prefix first), dfs-weight "
                                       "(requests sharing a cached prefix together, largest group first), "
                                       "fcfs (arrival), random (shuffled, seeded by --random-seed)",
                                ["lpm", "dfs-weight", "fcfs", "random"])
    schedule_conservativeness: float = _opt(1.0, "how much decode headroom to reserve when admitting")
    disable_radix_cache: bool = _opt(False, "use the chunk cache (no prefix sharing across requests)")
    disable_window_kv_trimming: bool = _opt(False, "models mixing sliding-window and global layers (Gemma-2): keep "
                                                   "every token's KV in the window layers too, instead of releasing "
                                                   "what no request's window can see (one pool for all layers)")
    window_kv_ratio: Optional[float] = _opt(None, "with window KV trimming: window-layer token slots per global-layer "
                                                  "slot of the same memory budget (default: sliding window / context "
                                                  "length, what context-long requests need; requests shorter than "
                                                  "the window need one per token, so short-request workloads want it "
                                                  "nearer 1.0)")
    enable_mixed_chunk: bool = _opt(False, "run the running requests' decode tokens in the same forward pass as a "
                                           "prefill batch instead of a pass of their own")
    disable_overlap_schedule: bool = _opt(False, "on CUDA, do each decode step's host bookkeeping after the GPU "
                                                 "finishes it instead of while it runs the next step")
    num_continuous_decode_steps: Optional[int] = _opt(None, "look at the waiting queue once per this many decode steps "
                                                            "(an extend between two decode steps stops the overlapped "
                                                            "schedule; more steps chain on the device, new requests "
                                                            "wait up to this many steps; default: 4 on CUDA, else 1)")
    max_continuous_decode_steps: Optional[int] = _opt(None, "while the free running slots would take fewer than "
                                                            "--admission-min-extend-tokens prompt tokens, look at the "
                                                            "waiting queue only after this many decode steps (default: "
                                                            "8 on CUDA when --num-continuous-decode-steps is unset, "
                                                            "else that value)")
    admission_min_extend_tokens: Optional[int] = _opt(None, "the prompt tokens an extend should hold before it is run "
                                                            "ahead of --max-continuous-decode-steps (default: 2048 on "
                                                            "CUDA when --num-continuous-decode-steps is unset, else 0)")

    # ---- kernels ----
    attention_backend: Optional[str] = _opt(None, "torch, triton or flashinfer (default: triton on GPU, torch on CPU)",
                                            ["torch", "triton", "flashinfer"])
    triton_attention_num_kv_splits: Optional[int] = _opt(
        None, "key splits of the Triton decode attention for every batch (default: 32 at batch 1 for 8 KV heads on "
        "an H200, at least 16, chosen per batch size; 4 on CPU)")
    disable_cuda_graph: bool = _opt(False, "run decode eagerly")
    cuda_graph_max_bs: int = _opt(512, "largest decode batch captured in a CUDA graph; also the most requests "
                                       "decoding at once when --max-running-requests is unset")
    cuda_graph_bs: Optional[tuple[int, ...]] = _opt(
        None, "the decode batch sizes captured in CUDA graphs, e.g. --cuda-graph-bs 1 8 32 (default: 1-4, then every "
        "4 to 32, every 8 to 160, every 16 to --cuda-graph-max-bs); a batch replays the smallest captured size that "
        "holds it, and sets --cuda-graph-max-bs to the largest")
    cuda_graph_max_extend_tokens: Optional[int] = _opt(
        None, "on CUDA, extend (prefill) passes of up to this many new tokens replay CUDA graphs captured at padded "
        "token counts instead of launching each kernel from Python (Triton attention; other backends run them "
        "eagerly); 0: never (default: 1024 on CUDA)")
    cuda_graph_max_extend_reqs: int = _opt(64, "most requests in one graphed extend pass (more run eagerly)")
    enable_torch_compile: bool = _opt(
        False, "torch.compile (Inductor) the model's non-attention parts for the decode batch sizes captured in CUDA "
        "graphs up to --torch-compile-max-bs; nothing changes without CUDA graphs (CPU, --disable-cuda-graph). Not "
        "faster than the default path where measured, at batch 1, 8 and 32 (Inductor launches the compiled kernels "
        "without PDL; docs/benchmarks.md, row 5)")
    torch_compile_max_bs: int = _opt(32, "largest decode batch that replays the compiled forward (with "
                                         "--enable-torch-compile); larger ones replay the eager one",
                                     aliases=("--max-torch-compile-bs",))
    disable_pdl: bool = _opt(False, "launch the decode path's Triton kernels without programmatic dependent launch "
                                    "(Hopper and later; ignored elsewhere)")
    disable_decode_gemv: bool = _opt(False, "decode batches of 1-16 rows through cuBLAS (bf16/fp16) or "
                                            "torch._scaled_mm (fp8) instead of braid's Triton GEMV kernels")
    disable_mla: bool = _opt(False, "MLA models (DeepSeek-V2): keep per-head K and V in the cache and attend in the expanded "
                                    "multi-head form instead of over the compressed latent (the baseline MLA is measured "
                                    "against; ~9x more KV per token)")
    disable_cpu_prepack: bool = _opt(False, "on CPU, multiply with the dense weights instead of oneDNN-prepacked copies")
    disable_cpu_malloc_tuning: bool = _opt(False, "on CPU, keep glibc's default malloc thresholds "
                                                  "(braid raises them so decode temporaries are reused)")

    # ---- parallelism ----
    tp_size: int = _opt(1, "tensor-parallel degree: one scheduler process per rank on torch.distributed (NCCL on "
                           "CUDA, gloo on CPU); heads, MLP and vocab split over the ranks (docs/parallelism.md)",
                        aliases=("--tp", "--tensor-parallel-size"))
    dp_size: int = _opt(1, "data-parallel degree: this many independent scheduler groups (each --tp-size ranks) behind "
                           "the server, requests routed to the group with the fewest in flight",
                        aliases=("--dp", "--data-parallel-size"))
    dist_init_addr: Optional[str] = _opt(None, "host:port of rank 0's torch.distributed rendezvous (default: a free "
                                               "loopback port; needed with --nnodes > 1; data-parallel group g uses "
                                               "port + g)", aliases=("--nccl-init-addr",))
    nnodes: int = _opt(1, "hosts the --tp-size ranks are spread over (each runs tp_size / nnodes of them)")
    node_rank: int = _opt(0, "this host's index among --nnodes; 0 serves HTTP, the others run their ranks only")
    base_gpu_id: int = _opt(0, "the first GPU this server's ranks use (rank r of a host: base + r); data-parallel "
                               "group g starts at base + g * tp_size")

    # ---- constrained decoding ----
    constrained_json_whitespace_pattern: Optional[str] = _opt(None, "regex for whitespace allowed in JSON output (default: compact)")
    disable_jump_forward: bool = _opt(False, "sample every token of a constrained output (the default on CUDA)",
                                      aliases=("--disable-regex-jump-forward",))
    enable_jump_forward: bool = _opt(
        False, "append the text a grammar forces without sampling it on CUDA too (on by default elsewhere): each jump "
        "re-enters the request through an extend pass, which on CUDA breaks the chained graphed decode steps of the "
        "whole batch and measured slower there (docs/benchmarks.md)")
    grammar_backend: str = _opt("llguidance", "grammar engine: llguidance (regex, JSON schema, Lark / GBNF grammars, "
                                              "structural tags), outlines (regex and JSON schema on outlines-core), "
                                              "auto (llguidance; a regex or schema it refuses goes to outlines)",
                                 choices=("llguidance", "outlines", "auto"))
    grammar_json_strict: bool = _opt(True, "llguidance: a JSON schema's object silent on extra properties allows "
                                           "none, a number without bounds has at most 18 integer digits and 9 "
                                           "decimals (as XGrammar's strict mode, SGLang's and vLLM's default, "
                                           "generates); off: as the specification reads")
    grammar_timeout_s: float = _opt(10.0, "give up compiling a grammar after this long")
    grammar_workers: int = _opt(0, "grammar compile workers (threads for llguidance, processes for outlines; 0: "
                                   "min(4, CPU count), at least 2); twice as many compiles run at once")
    grammar_max_queued: int = _opt(1024, "grammar compiles allowed to wait for a worker; a request that would start "
                                         "one more gets 429 with Retry-After")
    grammar_cache_size: int = _opt(512, "compiled grammars kept, least recently used dropped first")
    grammar_max_queued_per_client: int = _opt(256, "grammar compiles one HTTP client (by address) may have waiting; "
                                                   "clients' compiles are served in turn, so this only bounds a "
                                                   "burst (0: no limit; in-process requests share one queue)")

    # ---- speculative decoding (docs/api.md, "Speculative decoding") ----
    speculative_algorithm: Optional[str] = _opt(
        None, "draft several tokens a step and verify them in one pass of the model: NGRAM drafts by prompt lookup "
        "(the request's last tokens matched earlier in its prompt and output); EAGLE and EAGLE3 draft greedy chains, "
        "or trees with --speculative-eagle-topk > 1, with a draft head (--speculative-draft-model-path) fed with the "
        "target's hidden states; greedy output is the target's argmax at every position (token "
        "for token the plain output in fp32; bf16 may differ at near-ties), sampled output distributed the same "
        "(rejection sampling). Speculative steps run synchronously (no overlap schedule; the steps "
        "--speculative-disable-by-batch-size leaves to plain decode overlap)",
        ["NGRAM", "EAGLE", "EAGLE3"])
    speculative_draft_model_path: Optional[str] = _opt(None, "EAGLE / EAGLE3: the draft head's folder (config.json "
                                                             "and safetensors)")
    speculative_num_steps: Optional[int] = _opt(None, "draft depth: for chains the draft tokens a request a step, "
                                                      "--speculative-num-draft-tokens - 1 (EAGLE default 3)")
    speculative_eagle_topk: Optional[int] = _opt(None, "EAGLE / EAGLE3: draft branches per step (1: a chain; K > 1: "
                                                       "a tree, expanding the K best nodes of each depth K ways and "
                                                       "keeping the --speculative-num-draft-tokens - 1 best)")
    speculative_num_draft_tokens: Optional[int] = _opt(None, "tokens one verify pass takes per request, its last "
                                                             "token included (NGRAM default 5: 4 draft tokens)")
    speculative_ngram_min_match_window_size: Optional[int] = _opt(
        None, "NGRAM: the shortest suffix of the request's tokens looked up (default 2; vLLM's prompt_lookup_min)")
    speculative_ngram_max_match_window_size: Optional[int] = _opt(
        None, "NGRAM: the longest suffix looked up; longer matches are tried first (default 8; vLLM's "
        "prompt_lookup_max)")
    speculative_disable_by_batch_size: Optional[int] = _opt(
        None, "NGRAM: a step with more running requests than this decodes without drafts, where a verify pass of "
        "every request's draft would cost more than it saves (default: speculate at every batch size; vLLM's "
        "disable_by_batch_size)")
    speculative_config: Optional[str] = _opt(
        None, "vLLM's form, mapped onto the flags above: JSON such as '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 8}' (method ngram, eagle or eagle3; model, "
        "prompt_lookup_min, disable_by_batch_size)")

    # ---- LoRA adapters (docs/api.md, "LoRA adapters") ----
    enable_lora: bool = _opt(False, "serve LoRA adapters on the base model: a request picks one by native "
                                    "/generate 'lora_path' or OpenAI model 'adapter' / 'base:adapter'; batches mix "
                                    "adapters and the base model")
    lora_paths: Optional[tuple[str, ...]] = _opt(None, "PEFT adapter folders registered at start, as name=path (or "
                                                       "a path, named by its folder); implies --enable-lora. More "
                                                       "load and unload while serving (/load_lora_adapter)")
    max_loras_per_batch: int = _opt(8, "most distinct adapters one forward batch may use; a request on another "
                                       "adapter waits until one drains (vLLM: --max-loras)", aliases=("--max-loras",))
    max_loaded_loras: Optional[int] = _opt(None, "device slots for adapters (None: --max-loras-per-batch); any number "
                                                 "stay registered in host memory and are copied into a slot when a "
                                                 "request needs them, evicting the least recently used adapter no "
                                                 "running request uses")
    max_lora_rank: Optional[int] = _opt(None, "largest adapter rank accepted, the rank the adapter buffers are sized "
                                              "for (None: the largest of --lora-paths, or 16 without them)")
    lora_target_modules: Optional[tuple[str, ...]] = _opt(
        None, "projections adapters may target: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all "
        "(None: those the --lora-paths adapters target, or all without them); only their linears carry adapter "
        "buffers")

    # ---- server ----
    host: str = _opt("127.0.0.1", "HTTP host")
    port: int = _opt(30000, "HTTP port")
    api_key: Optional[str] = _opt(None, "require 'Authorization: Bearer <key>' on every route but /health (also "
                                        "from --api-key-file or the BRAID_API_KEY environment variable, which stay "
                                        "out of `ps`)")
    api_key_file: Optional[str] = _opt(None, "read the API key from this file (its first line)")
    max_body_bytes: int = _opt(8 * 1024 * 1024, "largest request body accepted (413 beyond it)")
    max_prompt_chars: int = _opt(1_000_000, "longest prompt text, or chat messages' text together, in characters "
                                            "(400 beyond it, checked before tokenizing)")
    tokenizer_threads: int = _opt(0, "threads that tokenize and apply chat templates off the event loop "
                                     "(0: min(4, CPU count))")
    max_queued_requests: Optional[int] = _opt(None, "most requests in flight beyond --max-running-requests; new "
                                                    "generation requests past it get 429 with Retry-After (None: no limit)")
    shutdown_timeout_s: float = _opt(10.0, "on SIGTERM, wait this long for in-flight requests")
    request_timeout_s: Optional[float] = _opt(None, "a generation request still running this many seconds after "
                                                    "it arrived ends with finish_reason 'abort' and the text "
                                                    "generated so far (None: no deadline)")
    log_level: str = _opt("info", "logging level of every process (debug, info, warning, error, critical)")
    log_stats_interval_s: float = _opt(10.0, "while serving, log running/queued requests, tokens/s, KV usage and "
                                             "cache hit rate at most this often (0: never)")
    log_requests: bool = _opt(False, "log every request")
    stream_interval: int = _opt(1, "streamed requests get an update every this many tokens (and when they finish)")

    # ---- images and video (vision models) ----
    allowed_local_media_path: Optional[str] = _opt(None, "image/video files may be read from this directory (and "
                                                         "below) by path or file:// URL (None: no local files)")
    allow_remote_media: bool = _opt(False, "fetch http(s) image URLs (never from loopback, private or reserved "
                                           "addresses, redirects included)")
    max_image_bytes: int = _opt(20 * 2**20, "largest encoded image or frame, in bytes (400 beyond it)")
    max_image_pixels: int = _opt(4096 * 4096, "most pixels in one decoded image or frame (400 beyond it)")
    max_video_frames: int = _opt(64, "most frames in one video (400 beyond it)")
    max_media_items: int = _opt(16, "most images and videos in one request (400 beyond it)")
    media_timeout_s: float = _opt(10.0, "longest time one remote image download may take (400 beyond it)")

    def running_requests_cap(self, kv_pool_tokens: int) -> int:
        """max_running_requests, or when it is unset the KV pool's share (one request per
        KV_TOKENS_PER_DERIVED_REQUEST of its tokens) within [DEFAULT_MAX_RUNNING_REQUESTS, max(that, cuda_graph_max_bs)]:
        256 with the default graphs, up to the graphs' largest batch when --cuda-graph-max-bs is raised."""
        if self.max_running_requests is not None:
            return self.max_running_requests
        derived = kv_pool_tokens // KV_TOKENS_PER_DERIVED_REQUEST
        upper = max(DEFAULT_MAX_RUNNING_REQUESTS, self.cuda_graph_max_bs)
        return max(DEFAULT_MAX_RUNNING_REQUESTS, min(upper, derived))

    def __post_init__(self):
        for name, aliases in VALUE_ALIASES.items():
            value = getattr(self, name)
            if value in aliases:
                object.__setattr__(self, name, aliases[value])
        if min(self.max_image_bytes, self.max_image_pixels, self.max_video_frames, self.max_media_items) < 1 \
                or self.media_timeout_s <= 0:
            raise ValueError("max_image_bytes, max_image_pixels, max_video_frames, max_media_items must be >= 1 and "
                             "media_timeout_s > 0")
        if self.chunked_prefill_size != -1 and self.chunked_prefill_size < 1:
            raise ValueError("chunked_prefill_size must be -1 or >= 1")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError("mem_fraction_static must be in (0, 1)")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError("max_total_tokens must be >= 16")
        if self.chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(f"chat_template_content_format {self.chat_template_content_format!r} is not one of "
                             "auto, string, openai")
        if self.window_kv_ratio is not None and not 0 < self.window_kv_ratio <= 1:
            raise ValueError("window_kv_ratio must be in (0, 1]")
        if self.window_kv_ratio is not None and self.disable_window_kv_trimming:
            raise ValueError("window_kv_ratio sizes the trimmed window-layer pool; it has no effect with "
                             "--disable-window-kv-trimming")
        if self.max_running_requests is None and self.max_queued_requests is not None:
            # the queue limit counts beyond a cap the server knows before the KV pool exists
            object.__setattr__(self, "max_running_requests", DEFAULT_MAX_RUNNING_REQUESTS)
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.grammar_max_queued_per_client < 0:
            raise ValueError("grammar_max_queued_per_client must be >= 0")
        if self.num_continuous_decode_steps is not None and self.num_continuous_decode_steps < 1:
            raise ValueError("num_continuous_decode_steps must be >= 1")
        if self.max_continuous_decode_steps is not None and self.max_continuous_decode_steps < max(
                1, self.num_continuous_decode_steps or 1):
            raise ValueError("max_continuous_decode_steps must be >= 1 and >= num_continuous_decode_steps")
        if self.admission_min_extend_tokens is not None and self.admission_min_extend_tokens < 0:
            raise ValueError("admission_min_extend_tokens must be >= 0")
        if self.enable_jump_forward and self.disable_jump_forward:
            raise ValueError("enable_jump_forward and disable_jump_forward contradict each other; drop one")
        if self.cuda_graph_bs is not None:
            if not self.cuda_graph_bs or min(self.cuda_graph_bs) < 1:
                raise ValueError("cuda_graph_bs must list batch sizes >= 1")
            object.__setattr__(self, "cuda_graph_bs", tuple(sorted(set(self.cuda_graph_bs))))
            object.__setattr__(self, "cuda_graph_max_bs", self.cuda_graph_bs[-1])
        if (self.cuda_graph_max_extend_tokens or 0) < 0 or self.cuda_graph_max_extend_reqs < 1:
            raise ValueError("cuda_graph_max_extend_tokens must be >= 0 and cuda_graph_max_extend_reqs >= 1")
        if self.triton_attention_num_kv_splits is not None and not 1 <= self.triton_attention_num_kv_splits <= 64:
            raise ValueError("triton_attention_num_kv_splits must be between 1 and 64")
        if self.tp_size < 1 or self.dp_size < 1:
            raise ValueError("tp_size and dp_size must be >= 1")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError("nnodes must be >= 1 and node_rank in [0, nnodes)")
        if self.base_gpu_id < 0:
            raise ValueError("base_gpu_id must be >= 0")
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size={self.tp_size} does not split over nnodes={self.nnodes} (each host runs "
                             "tp_size / nnodes ranks)")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("nnodes > 1 needs --dist-init-addr host:port (rank 0's host, reachable from every node)")
        if self.nnodes > 1 and self.dp_size > 1:
            raise ValueError("dp_size > 1 with nnodes > 1 is not supported; run one data-parallel server per host")
        if self.dist_init_addr is not None and not self.dist_init_addr.rpartition(":")[2].isdigit():
            raise ValueError(f"dist_init_addr {self.dist_init_addr!r} is not host:port")
        if self.tp_size > 1 and self.quantization is not None:
            raise ValueError(f"quantization={self.quantization!r} with tp_size > 1 is not supported yet (the fp8 "
                             "linear method loads whole weights); drop one of them")
        if self.tp_size > 1 and self.enable_torch_compile:
            raise ValueError("enable_torch_compile with tp_size > 1 is not supported yet; drop one of them")
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ValueError(f"log_level {self.log_level!r} is not one of debug, info, warning, error, critical")
        if self.stream_interval < 1:
            raise ValueError("stream_interval must be >= 1")
        if self.max_body_bytes < 1 or self.max_prompt_chars < 1:
            raise ValueError("max_body_bytes and max_prompt_chars must be >= 1")
        if self.tokenizer_threads < 0:
            raise ValueError("tokenizer_threads must be >= 0")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError("request_timeout_s must be > 0")
        if self.quantization == "fp8" and self.enable_torch_compile:
            raise ValueError("quantization='fp8' with enable_torch_compile is not supported yet (the fp8 kernels are "
                             "not traced by torch.compile); drop one of them")
        if self.calculate_kv_scales and self.kv_cache_dtype != "fp8_e4m3":
            raise ValueError(f"calculate_kv_scales sets the scales of an fp8_e4m3 KV cache; kv_cache_dtype is "
                             f"{self.kv_cache_dtype!r} (give --kv-cache-dtype fp8_e4m3, or drop the flag)")
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("give the API key once: --api-key or --api-key-file")
        self._check_lora()
        from braid.runtime.speculative import spec_args

        resolved = spec_args.resolve({name: getattr(self, name) for name in (*spec_args.FIELDS, "speculative_config")})
        for name, value in resolved.items():
            object.__setattr__(self, name, value)
        if self.attention_backend == "torch" and not self.disable_cuda_graph:
            # the torch backend runs attention with host-side loops over requests, which a graph cannot replay
            object.__setattr__(self, "disable_cuda_graph", True)

    def _check_lora(self) -> None:
        if self.lora_paths is not None:
            object.__setattr__(self, "lora_paths", tuple(self.lora_paths))
            object.__setattr__(self, "enable_lora", True)
        if self.lora_target_modules is not None:
            object.__setattr__(self, "lora_target_modules", tuple(self.lora_target_modules))
        if self.max_loras_per_batch < 1:
            raise ValueError("--max-loras-per-batch must be >= 1")
        if self.max_loaded_loras is None:
            object.__setattr__(self, "max_loaded_loras", self.max_loras_per_batch)
        if self.max_loaded_loras < 1:
            raise ValueError("--max-loaded-loras must be >= 1")
        if self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(f"--max-loaded-loras {self.max_loaded_loras} is below --max-loras-per-batch "
                             f"{self.max_loras_per_batch}: every adapter of a batch must be in a device slot; raise "
                             "--max-loaded-loras or lower --max-loras-per-batch")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError("--max-lora-rank must be >= 1")
        self.lora_target_module_set  # checks the names
        if not self.enable_lora:
            return
        self.lora_adapters  # checks the entries
        if self.speculative_algorithm or self.speculative_config:
            raise ValueError("--enable-lora with --speculative-algorithm is not supported yet")
        if self.quantization is not None:
            raise ValueError(f"--enable-lora with --quantization {self.quantization} is not supported yet")
        if self.enable_torch_compile:
            raise ValueError("--enable-lora with --enable-torch-compile is not supported yet")

    @property
    def lora_adapters(self) -> dict[str, str]:
        """--lora-paths as {name: folder}, in the order given (adapter i takes slot i)."""
        return parse_lora_paths(self.lora_paths)

    @property
    def lora_target_module_set(self) -> Optional[frozenset]:
        """--lora-target-modules as a set of HF projection names (None: unrestricted)."""
        if self.lora_target_modules is None:
            return None
        names = set(self.lora_target_modules)
        if "all" in names:
            return frozenset(LORA_TARGET_MODULES)
        unknown = sorted(names - set(LORA_TARGET_MODULES))
        if unknown:
            raise ValueError(f"--lora-target-modules {unknown} not supported; choose from "
                             f"{', '.join(LORA_TARGET_MODULES)} or all")
        return frozenset(names)

    # ---- derived ----
    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return os.path.basename(os.path.normpath(self.model_path)) or self.model_path

    def model_config_overrides(self) -> Optional[dict]:
        if self.model_config is None:
            return None
        text = self.model_config
        if not text.lstrip().startswith("{"):
            with open(text) as f:
                text = f.read()
        return json.loads(text)

    def replace(self, **kw) -> "ServerArgs":
        return dataclasses.replace(self, **kw)

    # ---- CLI ----
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
            help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %
            typ = hints[f.name]
            if typ is bool:
                parser.add_argument(*flags, dest=f.name, action="store_true", default=f.default, help=help_text)
                continue
            base = typing.get_args(typ)[0] if typing.get_origin(typ) is typing.Union else typ
            if typing.get_origin(base) is tuple:  # a list flag: --lora-paths a=x b=y
                parser.add_argument(*flags, dest=f.name, type=typing.get_args(base)[0], nargs="+",
                                    default=f.default, help=help_text)
                continue
            if f.name in VALUE_ALIASES:
                base = functools.partial(lambda aliases, text: aliases.get(text, text), VALUE_ALIASES[f.name])
                base.__name__ = "str"  # argparse names the type in its errors
            parser.add_argument(*flags, dest=f.name, type=base, default=f.default, choices=f.metadata.get("choices"),
                                help=help_text)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_kwargs(cls, **kw) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kw) - names)
        if unknown:
            raise TypeError(f"unknown server argument(s): {', '.join(unknown)}")
        return cls(**kw)
