"""Host time of one decode step at batch B: the scheduler's step minus the model's forward, and the output message
(build + msgspec encode) the scheduler process sends for it. The model is a one-layer dummy Llama, so the forward is
cheap and the host work stands out; every request streams, so every request reports on every step. The figures are
the fastest of --repeats runs of --steps steps (the machine is shared: the minimum is the least disturbed). As in the
server's scheduler process, the objects alive once the scheduler is built are frozen out of the garbage collector
(freeze_startup_objects; --no-gc-freeze leaves them in). The CPU runs the synchronous step (the overlap schedule is
CUDA only).

    python benchmarks/host_step_overhead.py --batch-size 64 256 512
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from braid.runtime.config import ServerArgs
from braid.runtime.core import Req
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.scheduler.scheduler import Scheduler, freeze_startup_objects
from braid.runtime.ipc import messages as M

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
              "vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "eos_token_id": 2}


def measure(batch_size: int, steps: int, repeats: int = 1, gc_freeze: bool = True) -> dict:
    sched = Scheduler(ServerArgs(model_path="smollm2", load_format="dummy", model_config=json.dumps(TINY_LLAMA),
                                 max_total_tokens=batch_size * 256, max_running_requests=batch_size,
                                 log_level="warning"))
    if gc_freeze:
        freeze_startup_objects()
    forward_s = [0.0]
    forward = sched.runner.forward

    def timed_forward(fb):
        start = time.perf_counter()
        out = forward(fb)
        forward_s[0] += time.perf_counter() - start
        return out

    sched.runner.forward = timed_forward
    for i in range(batch_size):
        sched.add_request(Req(rid=f"r{i}", input_ids=[5 + i % 50] * 32, stream=True,
                              sampling_params=SamplingParams(max_new_tokens=steps * repeats + 8, temperature=0,
                                                             ignore_eos=True)))
    while not sched.running:
        sched.step()
    best = None
    for _ in range(repeats):
        forward_s[0] = step_s = encode_s = 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            outputs = sched.step()
            t1 = time.perf_counter()
            M.encode(M.OutputBatch([M.output_from_req_output(o) for o in outputs]))
            encode_s += time.perf_counter() - t1
            step_s += t1 - t0
        ms = 1e3 / steps
        run = {"batch_size": batch_size, "step_ms": step_s * ms, "forward_ms": forward_s[0] * ms,
               "host_ms": (step_s - forward_s[0]) * ms, "message_ms": encode_s * ms}
        if best is None or run["host_ms"] + run["message_ms"] < best["host_ms"] + best["message_ms"]:
            best = run
    sched.shutdown()
    gc.unfreeze()  # the next batch size's scheduler is built in this process
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-gc-freeze", action="store_true", help="leave the startup objects to the collector")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'batch':>6}{'step ms':>10}{'forward ms':>12}{'host ms':>10}{'message ms':>12}")
    for bs in args.batch_size:
        r = measure(bs, args.steps, args.repeats, gc_freeze=not args.no_gc_freeze)
        print(f"{bs:>6}{r['step_ms']:>10.2f}{r['forward_ms']:>12.2f}{r['host_ms']:>10.2f}{r['message_ms']:>12.2f}")


if __name__ == "__main__":
    main()
