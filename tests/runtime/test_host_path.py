"""The scheduler's serving switches for the host path (issue 14): max_running_requests derived from the KV pool (up to
the largest CUDA-graph batch) when unset, and --num-continuous-decode-steps (the waiting queue looked at once per N decode steps, so that the
overlapped schedule keeps chaining while requests wait). Runs the real Scheduler on a one-layer dummy Llama."""

import argparse
import json

import pytest
import torch

from braid.runtime.config import ServerArgs
from braid.runtime.core import Req
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.scheduler.scheduler import Scheduler

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
              "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 1,
              "vocab_size": 128, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "eos_token_id": 2}


def scheduler(**kw) -> Scheduler:
    torch.set_num_threads(1)
    return Scheduler(ServerArgs(model_path="smollm2", load_format="dummy", model_config=json.dumps(TINY_LLAMA),
                                log_level="warning", **kw))


def add(sched: Scheduler, n: int, prompt_len: int, max_new) -> None:
    """n requests; max_new: one length for all, or a function of the request's number."""
    for i in range(n):
        sched.add_request(Req(rid=f"r{i}", input_ids=[3 + (i * 7 + j) % 100 for j in range(prompt_len)],
                              sampling_params=SamplingParams(max_new_tokens=max_new(i) if callable(max_new) else max_new,
                                                             temperature=0, ignore_eos=True)))


def run_to_end(sched: Scheduler, on_step) -> dict:
    done = {}
    while sched.has_work():
        for out in sched.step():
            if out.finished:
                done[out.rid] = out
        on_step()
    return done


def test_chosen_cuda_graph_batch_sizes():
    from braid.runtime.model_executor.cuda_graph import capture_batch_sizes

    args = ServerArgs(model_path="smollm2", cuda_graph_bs=(32, 8, 1, 8))
    assert args.cuda_graph_bs == (1, 8, 32) and args.cuda_graph_max_bs == 32  # the largest sets the cap
    assert capture_batch_sizes(32, args.cuda_graph_bs) == [1, 8, 32]
    assert capture_batch_sizes(16, args.cuda_graph_bs) == [1, 8]  # a smaller request pool drops the rest
    assert capture_batch_sizes(12) == [1, 2, 3, 4, 8, 12]
    for bad in ((), (0, 4)):
        with pytest.raises(ValueError, match="cuda_graph_bs"):
            ServerArgs(model_path="smollm2", cuda_graph_bs=bad)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    parsed = ServerArgs.from_cli_args(parser.parse_args(["--model-path", "smollm2", "--cuda-graph-bs", "4", "2"]))
    assert parsed.cuda_graph_bs == (2, 4)


def test_running_requests_cap_from_the_kv_pool():
    args = ServerArgs(model_path="smollm2")
    assert args.max_running_requests is None
    assert args.running_requests_cap(65536) == 256  # every CPU default pool keeps today's cap
    assert args.running_requests_cap(780_000) == 512  # the default graphs' largest batch (an H200 pool for 8B)
    assert args.running_requests_cap(100_000) == 100_000 // 256  # the pool's share when it is smaller
    assert args.running_requests_cap(1_000) == 256
    # eager batches past the graphs lost on the H200: the cap stays within them
    assert ServerArgs(model_path="smollm2", cuda_graph_max_bs=160).running_requests_cap(780_000) == 256
    assert ServerArgs(model_path="smollm2", cuda_graph_max_bs=1024).running_requests_cap(780_000) == 1024
    assert ServerArgs(model_path="smollm2", max_running_requests=64).running_requests_cap(10**6) == 64
    # --max-queued-requests counts beyond a cap the HTTP server knows up front
    assert ServerArgs(model_path="smollm2", max_queued_requests=10).max_running_requests == 256
    with pytest.raises(ValueError, match="num_continuous_decode_steps"):
        ServerArgs(model_path="smollm2", num_continuous_decode_steps=0)
    with pytest.raises(ValueError, match="max_continuous_decode_steps"):
        ServerArgs(model_path="smollm2", num_continuous_decode_steps=4, max_continuous_decode_steps=2)
    with pytest.raises(ValueError, match="admission_min_extend_tokens"):
        ServerArgs(model_path="smollm2", admission_min_extend_tokens=-1)


def test_derived_cap_admits_past_256_and_ends_clean():
    sched = scheduler(max_total_tokens=131072)  # 512 requests' worth by the derivation
    assert sched.get_stats()["effective_max_running_requests"] == 512
    add(sched, 400, prompt_len=8, max_new=6)
    peak = [0]

    def watch():
        peak[0] = max(peak[0], len(sched.running))

    done = run_to_end(sched, watch)
    assert peak[0] > 256  # the old fixed cap no longer holds admission back
    assert len(done) == 400 and all(o.completion_tokens == 6 for o in done.values())
    stats = sched.get_stats()
    assert stats["num_running_reqs"] == 0 and stats["kv_used_tokens"] == 0


def extend_gaps(sched: Scheduler) -> list:
    """Records, per extend batch formed, (decode passes launched so far, requests decoding beside it)."""
    extends, admit = [], sched._admit

    def recording_admit():
        batch = admit()
        if batch:
            extends.append((sched.decode.num_forward, len(sched.running)))
        return batch

    sched._admit = recording_admit
    return extends


@pytest.mark.parametrize("overlap", [False, True])
def test_continuous_decode_steps_pace_admission(overlap):
    steps = 4
    sched = scheduler(max_total_tokens=8192, max_running_requests=4, num_continuous_decode_steps=steps)
    assert sched.get_stats()["effective_num_continuous_decode_steps"] == steps
    sched.decode.overlap = overlap  # the chained schedule's bookkeeping runs on CPU too
    extends = extend_gaps(sched)
    add(sched, 16, prompt_len=6, max_new=lambda i: 3 + i % 5)
    done = run_to_end(sched, lambda: None)
    assert len(done) == 16 and all(o.completion_tokens == 3 + int(rid[1:]) % 5 for rid, o in done.items())
    # requests end after 3..7 tokens, so a slot frees every step or two while requests wait; yet an extend comes
    # only `steps` decode passes after the one before, unless nothing was decoding any more
    assert len(extends) >= 4
    for (before, _), (at, decoding) in zip(extends, extends[1:]):
        assert at - before >= steps or decoding == 0, extends
    if overlap:
        assert sched.get_stats()["num_decode_overlapped"] >= 8  # chained while requests were waiting
    stats = sched.get_stats()
    assert stats["num_running_reqs"] == 0 and stats["kv_used_tokens"] == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_small_extends_wait_for_max_continuous_decode_steps(overlap):
    """Past --num-continuous-decode-steps (2), an extend whose free slots would take fewer than
    --admission-min-extend-tokens (40) prompt tokens waits for --max-continuous-decode-steps (6): 6-token prompts
    (4 slots hold 24 at most) come 6 passes apart; 30-token prompts come as soon as two slots are free."""
    gaps = {}
    for prompt_len in (6, 30):
        sched = scheduler(max_total_tokens=8192, max_running_requests=4, num_continuous_decode_steps=2,
                          max_continuous_decode_steps=6, admission_min_extend_tokens=40)
        stats = sched.get_stats()
        assert (stats["effective_max_continuous_decode_steps"], stats["effective_admission_min_extend_tokens"]) == (6, 40)
        sched.decode.overlap = overlap
        extends = extend_gaps(sched)
        add(sched, 24, prompt_len=prompt_len, max_new=lambda i: 6 + i * 5 % 11)  # 6..16: slots free while others run
        done = run_to_end(sched, lambda: None)
        assert len(done) == 24 and sched.get_stats()["kv_used_tokens"] == 0
        gaps[prompt_len] = [at - before for (before, _), (at, decoding) in zip(extends, extends[1:]) if decoding]
        assert len(gaps[prompt_len]) >= 3 and min(gaps[prompt_len]) >= 2, extends
    assert min(gaps[6]) >= 6, gaps
    assert min(gaps[30]) < 6, gaps


def test_one_decode_step_between_checks_is_the_cpu_default():
    sched = scheduler(max_total_tokens=8192, max_running_requests=4)
    assert sched.server_args.num_continuous_decode_steps is None
    stats = sched.get_stats()
    assert stats["effective_num_continuous_decode_steps"] == 1  # 4 on CUDA
    assert (stats["effective_max_continuous_decode_steps"], stats["effective_admission_min_extend_tokens"]) == (1, 0)
    add(sched, 12, prompt_len=6, max_new=lambda i: 3 + i % 5)
    kinds = []
    last = [0, 0]

    def record():
        s = sched.get_stats()
        kinds.append("E" * (s["num_forward_extend"] - last[0]) + "D" * (s["num_forward_decode"] - last[1]))
        last[:] = s["num_forward_extend"], s["num_forward_decode"]

    run_to_end(sched, record)
    # a request ends, a slot frees, and the next step admits: extends come one decode pass apart
    assert "DED" in "".join(kinds), kinds


def test_extend_time_is_counted_in_the_steps_that_run_extends():
    """stats extend_time_s_total: the part of step() spent on extend passes; it grows in the steps that run one (by
    at most their own time) and in no other."""
    sched = scheduler(max_total_tokens=8192, max_running_requests=4)
    add(sched, 10, prompt_len=40, max_new=lambda i: 2 + i % 4)
    grew_with_extend = grew_without = 0
    while sched.has_work():
        before = sched.get_stats()
        sched.step()
        after = sched.get_stats()
        extend_s = after["extend_time_s_total"] - before["extend_time_s_total"]
        step_s = after["step_time_s_total"] - before["step_time_s_total"]
        if after["num_forward_extend"] > before["num_forward_extend"]:
            assert 0 < extend_s <= step_s
            grew_with_extend += 1
        else:
            grew_without += extend_s > 0
    assert grew_with_extend >= 3 and grew_without == 0
    stats = sched.get_stats()
    assert 0 < stats["extend_time_s_total"] < stats["step_time_s_total"]
