"""--dp-size 2: two independent scheduler groups behind one server, requests routed to the least busy one; a group
that dies takes the server down (non-zero exit)."""

from concurrent.futures import ThreadPoolExecutor

import psutil

from braid.runtime.processes.data_parallel import merge_stats
from real_server import start_server


def test_merge_stats_sums_counts_averages_rates_keeps_agreed_values_and_each_group():
    merged = merge_stats([{"kv_used_tokens": 3, "cache_hit_rate": 0.2, "model": "a", "lora_slots": ["x", None]},
                          {"kv_used_tokens": 5, "cache_hit_rate": 0.4, "model": "a", "lora_slots": [None, "x"]}])
    assert merged["kv_used_tokens"] == 8 and abs(merged["cache_hit_rate"] - 0.3) < 1e-9
    # what every group agrees on stays; what differs only in each group's own stats
    assert merged["model"] == "a" and "lora_slots" not in merged
    assert [g["kv_used_tokens"] for g in merged["dp_groups"]] == [3, 5]


def test_two_groups_serve_64_concurrent_requests_each_answered_once():
    srv = start_server(["--model-path", "smollm2", "--dp-size", "2", "--max-total-tokens", "2048",
                        "--api-key", "k", "--log-stats-interval-s", "0"], "k", "braid-dp2-")
    try:
        def one(i: int) -> tuple[int, dict]:
            r = srv.post("/generate", {"text": f"Item {i}:", "rid": f"dp-{i}",
                                       "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}})
            return r.status_code, r.json()

        with ThreadPoolExecutor(64) as pool:
            results = list(pool.map(one, range(64)))
        assert all(status == 200 for status, _ in results), [r for r in results if r[0] != 200][:2]
        assert sorted(body["meta_info"]["id"] for _, body in results) == sorted(f"dp-{i}" for i in range(64))
        assert all(body["meta_info"]["completion_tokens"] == 4 for _, body in results)
        info = srv.get("/get_server_info").json()
        groups = info["dp_groups"]
        assert info["dp_size"] == 2 and len(groups) == 2
        assert [g["num_requests_total"] > 0 for g in groups] == [True, True], [g["num_requests_total"] for g in groups]
        assert sum(g["num_requests_total"] for g in groups) == info["num_requests_total"] == 64
        assert info["kv_used_tokens"] == 0 and all(g["kv_used_tokens"] == 0 for g in groups)
        assert srv.post("/flush_cache").status_code == 200

        # a group that dies takes the server to its error state
        controller = next(c for c in psutil.Process(srv.proc.pid).children()
                          if "braid.runtime.processes.data_parallel" in " ".join(c.cmdline()))
        groups = [c for c in controller.children() if "braid.runtime.processes.scheduler_process" in " ".join(c.cmdline())]
        assert len(groups) == 2
        groups[1].kill()
        assert srv.proc.wait(20) != 0
    finally:
        srv.stop()


def test_the_in_process_engine_refuses_data_parallelism():
    import pytest

    from braid.runtime import Engine

    with pytest.raises(ValueError, match="dp_size > 1 is a server feature"):
        Engine(model_path="smollm2", dp_size=2, log_level="error")
