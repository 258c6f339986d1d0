"""Kernel launches of one Gemma-2 decode step at batch 1, per decoder layer, counted on the CPU: a tiny Gemma-2 config
(dummy weights, bf16, Triton attention backend) runs under TRITON_INTERPRET=1 while tensors report `is_cuda`, so
every layer takes the code path it takes on a GPU (the batch-1 GEMV, the fused norm kernels, the KV pool's fused
rotary store) but its kernels run in the interpreter. Counted: Triton kernel launches and the PyTorch ops that
launch a kernel on a GPU (views, allocations and metadata ops excluded). What a CUDA graph would capture is the
model's forward; the LM head, soft-cap and argmax after it run eagerly and are counted apart.

  python benchmarks/gpu/gemma2_decode_launches.py            (one table: launches per layer, by kernel)
"""

from __future__ import annotations

import collections
import json
import os
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel modules are imported

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# ops that launch no kernel on a GPU (views, metadata, allocation without a fill)
NO_KERNEL = {"view", "_unsafe_view", "reshape", "slice", "select", "split", "split_with_sizes", "t", "transpose",
             "expand", "as_strided", "detach", "alias", "unsqueeze", "squeeze", "permute", "empty", "empty_strided",
             "empty_like", "new_empty", "new_empty_strided", "_reshape_alias", "lift_fresh", "unbind", "chunk",
             "narrow", "_to_copy_noop", "sym_size", "sym_stride", "sym_numel", "is_same_size", "_local_scalar_dense"}

TINY_GEMMA2 = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 32,
    "sliding_window": 16, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "max_position_embeddings": 512, "vocab_size": 512, "tie_word_embeddings": True,
    "attention_bias": False, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "torch_dtype": "bfloat16"}


class LaunchCounter(TorchDispatchMode):
    """Records (scope, kernel name) for every kernel-launching op and Triton launch while `active`."""

    def __init__(self):
        super().__init__()
        self.active = False
        self.scope = "before layers"
        self.launches: list[tuple[str, str]] = []
        self._in_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.active and not self._in_triton:
            name = func.overloadpacket.__name__
            no_op = name == "to" and args and out is args[0]  # already of that dtype and device
            if name not in NO_KERNEL and not no_op:
                self.launches.append((self.scope, f"aten.{name}"))
        return out

    def triton_run(self, name: str, run):
        if self.active and not self._in_triton:
            self.launches.append((self.scope, f"triton.{name}"))
        self._in_triton += 1
        try:
            return run()
        finally:
            self._in_triton -= 1


def count_decode_step(config: dict = TINY_GEMMA2, context: int = 40, decode_steps: int = 1, batch: int = 1,
                      qkv_epilogue: bool = True, **server_args) -> LaunchCounter:
    """Builds the tiny model (ServerArgs fields `server_args` on top), prefills `batch` requests of `context` tokens,
    counts the launches of the `decode_steps` decode steps after it; the counter's `output_ids` are the tokens
    generated. qkv_epilogue=False: the pool offers the batch-1 qkv GEMV no cache to write, so rotary and the KV
    store run as their own kernel after it (the path the epilogue replaced, for comparison)."""
    from triton.runtime.interpreter import InterpretedFunction

    from braid.runtime.bench.bench_one_batch import StaticBatchRunner
    from braid.runtime.config import ServerArgs
    from braid.runtime.mem_cache import pools
    from braid.runtime.model_executor import model_runner as mr

    folder = tempfile.mkdtemp(prefix="gemma2_launches_")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    args = ServerArgs(model_path="gemma2-dummy", load_format="dummy", model_config=os.path.join(folder, "config.json"),
                      dtype="bfloat16", attention_backend="triton", device="cpu", max_total_tokens=4096,
                      max_running_requests=4, log_level="warning", **server_args)
    # Triton on CPU tensors (the interpreter runs the kernels): the backend and the pool's fused KV stores
    patched = [(mr, "check_backend_device", lambda name, device: None),
               (pools, "_triton_kernels_run_on", lambda device: True)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patched]
    for module, name, value in patched:
        setattr(module, name, value)
    try:
        runner = mr.ModelRunner(args)
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
    counter = LaunchCounter()
    original_run = InterpretedFunction.run

    def counted_run(self, *a, **kw):
        return counter.triton_run(self.fn.__name__, lambda: original_run(self, *a, **kw))

    layers = runner.model.model.layers
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: setattr(counter, "scope", f"layer {i}"))
             for i, layer in enumerate(layers)]
    hooks.append(runner.model.model.norm.register_forward_pre_hook(
        lambda m, a: setattr(counter, "scope", "final norm")))
    forward = runner.forward

    def counted_forward(fb):
        if not fb.forward_mode.is_decode():
            return forward(fb)
        counter.scope, counter.active = "before layers", True
        try:
            out = forward(fb)
        finally:
            counter.active = False
        return out

    hooks.append(runner.model.register_forward_hook(lambda m, a, o: setattr(counter, "scope", "after the model")))
    runner.forward = counted_forward
    is_cuda = torch.Tensor.is_cuda
    store_target = pools.MHAKVPool.rotary_store_target
    if not qkv_epilogue:
        pools.MHAKVPool.rotary_store_target = lambda self, layer_id, loc: None
    InterpretedFunction.run = counted_run
    torch.Tensor.is_cuda = property(lambda self: True)  # the GPU dispatch path, on CPU tensors
    try:
        with counter:
            counter.output_ids = StaticBatchRunner(runner).run([[5] * context] * batch, decode_steps + 1).output_ids
    finally:
        torch.Tensor.is_cuda = is_cuda
        pools.MHAKVPool.rotary_store_target = store_target
        InterpretedFunction.run = original_run
        for h in hooks:
            h.remove()
    return counter


def main() -> int:
    counter = count_decode_step()
    by_scope = collections.defaultdict(collections.Counter)
    for scope, name in counter.launches:
        by_scope[scope][name] += 1
    print(f"Gemma-2 decode step at batch 1 (tiny config, GPU dispatch path): {len(counter.launches)} launches")
    for scope, names in by_scope.items():
        print(f"{scope:>16}: {sum(names.values()):3d}  " + ", ".join(f"{n} x{c}" if c > 1 else n
                                                                   for n, c in names.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
