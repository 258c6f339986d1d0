"""LoRA with --dp-size 2: adapter loads and unloads reach both scheduler groups, so whichever group a request lands
in serves its adapter with peft's greedy tokens; a refused load is refused once for all, and a load some groups took
and others refused is unloaded from those that took it."""

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from braid.runtime.ipc import messages as M
from braid.runtime.processes.data_parallel import DataParallelController
from lora_tiny import VOCAB, peft_greedy, write_all, write_misfit
from real_server import start_server

API_KEY = "lora-dp-key"
NEW = 6


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_dp")
    out = write_all(root)
    write_misfit(out["sql"], str(root / "misfit"))
    out["misfit"] = str(root / "misfit")
    return out


def test_loads_reach_both_groups_and_both_serve_peft_tokens(paths):
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 13, 7, 11)]
    jobs = [(i, name) for i in range(len(prompts)) for name in (None, "sql", "router")]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server's schedulers run
    try:
        refs = peft_greedy(paths["base"], {"sql": paths["sql"], "router": paths["router"]},
                           [prompts[i] for i, _ in jobs], [n for _, n in jobs], NEW)
    finally:
        torch.set_num_threads(threads)
    srv = start_server(["--model-path", paths["base"], "--dp-size", "2", "--enable-lora", "--max-lora-rank", "8",
                        "--max-total-tokens", "2048", "--api-key", API_KEY, "--log-stats-interval-s", "0",
                        "--log-level", "warning"], API_KEY, "braid-lora-dp-")
    try:
        for name in ("sql", "router"):
            r = srv.post("/load_lora_adapter", {"lora_name": name, "lora_path": paths[name]})
            assert r.status_code == 200, r.text
        info = srv.get("/get_server_info").json()
        assert info["lora_registered_adapters"] == ["sql", "router"]
        assert [g["lora_registered_adapters"] for g in info["dp_groups"]] == [["sql", "router"]] * 2

        def one(job):
            i, name = job
            return srv.post("/generate", {"input_ids": prompts[i], "lora_path": name, "sampling_params":
                                          {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}})

        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(one, jobs * 2))
        for job, want, r in zip(jobs * 2, refs * 2, answers):
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == want, job
        groups = srv.get("/get_server_info").json()["dp_groups"]
        assert all(g["lora_slot_loads_total"] > 0 for g in groups), [g["lora_slot_loads_total"] for g in groups]

        r = srv.post("/load_lora_adapter", {"lora_name": "bad", "lora_path": paths["misfit"]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "lora_invalid", r.text
        r = srv.post("/unload_lora_adapter", {"lora_name": "sql"})
        assert r.status_code == 200 and r.json()["loaded_adapters"] == {"router": paths["router"]}, r.text
        assert one((0, "sql")).status_code == 400
        info = srv.get("/get_server_info").json()
        assert [g["lora_registered_adapters"] for g in info["dp_groups"]] == [["router"]] * 2
        assert info["kv_used_tokens"] == 0
    finally:
        srv.stop()


class _Socket:
    def __init__(self):
        self.sent = []

    def send(self, data):
        self.sent.append(M.decode_to_scheduler(data))


def test_a_load_refused_by_one_group_is_unloaded_from_the_other():
    groups = [SimpleNamespace(index=i, send=_Socket()) for i in range(3)]
    controller = SimpleNamespace(groups=groups, lora_loads={7: M.LoadLoraReq(7, "sql", "/x")},
                                 rollback_ids=iter(range(-1, -100, -1)))
    refusal = M.LoraResult(7, False, "no slot memory", "internal_error", None)
    answer = DataParallelController.lora_answer(controller, 7, [M.LoraResult(7, True), refusal, M.LoraResult(7, True)])
    assert answer == refusal and controller.lora_loads == {}
    assert [g.send.sent for g in groups] == [[M.UnloadLoraReq(-1, "sql")], [], [M.UnloadLoraReq(-2, "sql")]]
    # all ok: the first answer, nothing sent; an unload refused somewhere: the refusal, nothing rolled back
    assert DataParallelController.lora_answer(controller, 8, [M.LoraResult(8, True)] * 3).ok
    assert DataParallelController.lora_answer(controller, 9, [M.LoraResult(9, True), M.LoraResult(9, False, "x")] +
                                              [M.LoraResult(9, True)]).message == "x"
    assert [len(g.send.sent) for g in groups] == [1, 0, 1]
