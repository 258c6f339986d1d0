"""SGLang v0.3 `launch_server` flags (v0.3.0 to v0.3.6) that ServerArgs has no field for.

Flags spelled differently but meaning the same are aliases on ServerArgs' fields (config.py: `--tp`,
`--tensor-parallel-size`, `--disable-regex-jump-forward`, `--json-model-override-args`, `--attention-backend
torch_native`, ...). The flags here are parsed too, so that a launch command written for SGLang gets an answer
instead of argparse's "unrecognized arguments": a flag (or value) asking for what braid does anyway is accepted and
one INFO line says so; every other one is refused before anything loads, saying what to use instead.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class SglangFlag:
    hint: str  # what braid does instead
    nargs: Optional[str] = None  # None: a bare switch; "1": one value; "*": values
    already: tuple[str, ...] = ()  # values (for a switch: ("on",)) that ask for what braid does anyway
    opposite: Optional[str] = None  # the ServerArgs field that asks for the contrary: both given is an error


_NO_LORA = ("braid serves no LoRA adapters; merge the adapter into the weights (peft's merge_and_unload) and serve "
            "that folder")
_NO_DOUBLE_SPARSITY = "braid has no double-sparsity attention"
_NO_DOWNLOADS = "braid downloads nothing; point --model-path at a local folder holding the revision you want"

SGLANG_FLAGS: dict[str, SglangFlag] = {
    # ---- braid does this already ----
    "--enable-mla": SglangFlag("MLA is on by default for DeepSeek-V2 models (--disable-mla turns it off)",
                               already=("on",), opposite="disable_mla"),
    "--enable-overlap-schedule": SglangFlag("the overlap schedule is on by default on CUDA "
                                            "(--disable-overlap-schedule turns it off)",
                                            already=("on",), opposite="disable_overlap_schedule"),
    "--disable-disk-cache": SglangFlag("braid keeps compiled grammars in memory only, never on disk", already=("on",)),
    "--disable-outlines-disk-cache": SglangFlag("braid keeps compiled grammars in memory only, never on disk",
                                                already=("on",)),
    "--disable-flashinfer-sampling": SglangFlag("braid samples with its own torch code, never FlashInfer's sampling "
                                                "kernels", already=("on",)),
    "--sampling-backend": SglangFlag("braid samples with its own torch code; there is no FlashInfer sampling backend",
                                     nargs="1", already=("pytorch",)),
    "--disable-custom-all-reduce": SglangFlag("tensor-parallel all-reduces go through torch.distributed (NCCL); braid "
                                              "has no custom all-reduce kernel", already=("on",)),
    "--disable-nan-detection": SglangFlag("braid has no NaN detection to turn off", already=("on",)),
    "--triton-attention-reduce-in-fp32": SglangFlag("braid's Triton attention kernels accumulate in fp32 always",
                                                    already=("on",)),
    "--enable-metrics": SglangFlag("GET /metrics (Prometheus) is always served", already=("on",)),
    "--enable-cache-report": SglangFlag("the OpenAI routes always report usage.prompt_tokens_details.cached_tokens",
                                        already=("on",)),
    "--load-balance-method": SglangFlag("with --dp-size > 1 braid sends each request to the group with the fewest "
                                        "in flight (shortest_queue); there is no round_robin",
                                        nargs="1", already=("shortest_queue",)),
    "--tokenizer-mode": SglangFlag("braid uses the tokenizer's fast implementation; there is no slow mode",
                                   nargs="1", already=("auto",)),
    "--cpu-offload-gb": SglangFlag("braid keeps every weight on the device; there is no CPU offload",
                                   nargs="1", already=("0",)),
    # ---- refused ----
    "--is-embedding": SglangFlag("braid serves generation models only (no /encode, no /v1/embeddings); /generate "
                                 "with return_logprob and logprob_start_len=0 scores a prompt"),
    "--skip-tokenizer-init": SglangFlag("braid always loads the tokenizer (stop strings, constrained decoding and chat "
                                        "templates need it); /generate already takes input_ids and returns output_ids "
                                        "beside the text"),
    "--revision": SglangFlag(_NO_DOWNLOADS, nargs="1"),
    "--download-dir": SglangFlag(_NO_DOWNLOADS, nargs="1"),
    "--additional-ports": SglangFlag("braid's processes talk over ipc:// sockets and need no extra ports; drop it",
                                     nargs="*"),
    "--disable-flashinfer": SglangFlag("use --attention-backend triton (CUDA) or --attention-backend torch"),
    "--disable-cuda-graph-padding": SglangFlag("braid pads a decode batch to the next captured size; "
                                               "--disable-cuda-graph runs decode eagerly and --cuda-graph-max-bs "
                                               "bounds the captured sizes"),
    "--max-num-reqs": SglangFlag("braid sizes its request slots from --max-running-requests", nargs="1"),
    "--log-level-http": SglangFlag("--log-level sets every logger, the HTTP server's included", nargs="1"),
    "--show-time-cost": SglangFlag("braid has no time-cost marks; the stats line (--log-stats-interval-s) and "
                                   "GET /metrics report throughput and latencies"),
    "--decode-log-interval": SglangFlag("braid logs its stats line every --log-stats-interval-s seconds instead of "
                                        "every N decode batches", nargs="1"),
    "--file-storage-pth": SglangFlag("braid stores no files", nargs="1"),
    "--watchdog-timeout": SglangFlag("braid has no forward-pass watchdog; --request-timeout-s ends a request that "
                                     "runs too long", nargs="1"),
    "--enable-double-sparsity": SglangFlag(_NO_DOUBLE_SPARSITY),
    "--ds-channel-config-path": SglangFlag(_NO_DOUBLE_SPARSITY, nargs="1"),
    "--ds-heavy-channel-num": SglangFlag(_NO_DOUBLE_SPARSITY, nargs="1"),
    "--ds-heavy-token-num": SglangFlag(_NO_DOUBLE_SPARSITY, nargs="1"),
    "--ds-heavy-channel-type": SglangFlag(_NO_DOUBLE_SPARSITY, nargs="1"),
    "--ds-sparse-decode-threshold": SglangFlag(_NO_DOUBLE_SPARSITY, nargs="1"),
    "--lora-paths": SglangFlag(_NO_LORA, nargs="*"),
    "--max-loras-per-batch": SglangFlag(_NO_LORA, nargs="1"),
    "--enable-dp-attention": SglangFlag("braid's --dp-size runs whole model replicas; there is no data-parallel "
                                        "attention"),
    "--torchao-config": SglangFlag("braid has no torchao path; --quantization fp8 stores linear weights in fp8",
                                   nargs="1"),
    "--enable-nan-detection": SglangFlag("braid has no NaN detection"),
    "--enable-p2p-check": SglangFlag("braid leaves GPU-to-GPU transport to NCCL; there is no P2P check"),
    "--efficient-weight-load": SglangFlag("braid has no per-layer quantize-while-loading mode (--quantization fp8 "
                                          "quantizes once the weights are loaded); drop the flag"),
    "--delete-ckpt-after-loading": SglangFlag("braid never deletes a checkpoint"),
    "--disable-penalizer": SglangFlag("braid applies penalties only to requests that ask for them; to skip them, "
                                      "send none"),
}


def _dest(flag: str) -> str:
    return "sglang_" + flag[2:].replace("-", "_")


def add_sglang_flags(parser: argparse.ArgumentParser) -> None:
    """Parse the flags above, hidden from --help (its epilog says where they are listed); one that ServerArgs has
    meanwhile gained as a field or alias is left to ServerArgs."""
    for flag, spec in SGLANG_FLAGS.items():
        if flag in parser._option_string_actions:
            continue
        if spec.nargs is None:
            parser.add_argument(flag, dest=_dest(flag), action="store_const", const="on", default=None,
                                help=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, dest=_dest(flag), nargs=None if spec.nargs == "1" else spec.nargs,
                                default=None, help=argparse.SUPPRESS)


def check_sglang_flags(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(notices for the flags accepted, errors for the flags refused), one line each."""
    notices, errors = [], []
    for flag, spec in SGLANG_FLAGS.items():
        value = getattr(args, _dest(flag), None)
        if value is None:
            continue
        shown = flag if spec.nargs is None else f"{flag} {' '.join(value) if isinstance(value, list) else value}"
        if spec.opposite is not None and getattr(args, spec.opposite):
            errors.append(f"{flag} and --{spec.opposite.replace('_', '-')} contradict each other; give one")
        elif value in spec.already:
            notices.append(f"{shown} (an SGLang flag) has no effect: {spec.hint}")
        else:
            errors.append(f"{shown} (an SGLang flag) is not supported: {spec.hint}")
    return notices, errors
