"""POST /abort_request on a non-streamed request returns the text generated until the abort (finish_reason abort),
on /generate and /v1/completions, and gives the KV back; when the scheduler's abort output does not come (it
finished the request already, or never had it), the request still ends within a bounded wait."""

import asyncio
import threading
import time

import pytest

from braid.runtime.config import ServerArgs
from braid.runtime.core import Req
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.ipc import messages as M
from braid.runtime.server import tokenizer_manager as tm_module
from braid.runtime.server.tokenizer_manager import TokenizerManager
from server_helpers import wait_idle

MAX_TOKENS = 400


def generated_tokens(server) -> int:
    return server.get("/get_server_info").json()["num_generated_tokens_total"]


def abort_after_a_few_tokens(server, path: str, body: dict, rid: str) -> dict:
    """Post `body` without streaming; once the scheduler has produced some tokens, abort `rid`."""
    wait_idle(server)
    before = generated_tokens(server)
    result, errors = {}, []

    def run():
        try:
            r = server.post(path, json=body)
            result["status"], result["json"] = r.status_code, r.json()
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.time() + 60
    while generated_tokens(server) < before + 5:
        assert time.time() < deadline and thread.is_alive(), "the request produced no tokens"
        time.sleep(0.05)
    r = server.post("/abort_request", json={"rid": rid})
    assert r.status_code == 200 and r.json() == {"success": True, "rid": rid}
    thread.join(60)
    assert not errors and result["status"] == 200, (errors, result)
    wait_idle(server)
    return result["json"]


def test_abort_keeps_the_text_on_generate(server):
    body = {"text": "Once", "rid": "abort-native", "sampling_params": {"max_new_tokens": MAX_TOKENS,
                                                                     "ignore_eos": True}}
    out = abort_after_a_few_tokens(server, "/generate", body, "abort-native")
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < meta["completion_tokens"] < MAX_TOKENS and len(out["output_ids"]) == meta["completion_tokens"]
    assert out["text"] and out["text"] == server.post("/detokenize", json={"tokens": out["output_ids"]}).json()["text"]


def test_abort_keeps_the_text_on_completions(server):
    body = {"prompt": "Once", "max_tokens": MAX_TOKENS, "ignore_eos": True, "rid": "abort-openai", "temperature": 0}
    out = abort_after_a_few_tokens(server, "/v1/completions", body, "abort-openai")
    choice, usage = out["choices"][0], out["usage"]
    assert choice["finish_reason"] == "abort"
    assert 0 < usage["completion_tokens"] < MAX_TOKENS and choice["text"]
    # greedy: the text is the start of what the full request produces
    full = server.post("/v1/completions", json={**body, "rid": "abort-openai-full",
                                                "max_tokens": usage["completion_tokens"]}).json()
    assert full["choices"][0]["text"] == choice["text"]


# ---- TokenizerManager without a scheduler process: the bounded wait ----

class _RecordingSocket:
    def __init__(self):
        self.sent = []

    async def send(self, data, *args, **kwargs):
        self.sent.append(M.decode_to_scheduler(bytes(data)))


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True, **kwargs):
        return "".join(chr(ord("a") + i % 26) for i in ids)


async def _manager_with_request(rid: str, stream: bool):
    tm = TokenizerManager(ServerArgs(model_path="smollm2"))
    tm._loop = asyncio.get_running_loop()
    tm._send = _RecordingSocket()
    tm.tokenizer = _Tokenizer()
    req = Req(rid=rid, input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=100), stream=stream)
    return tm, await tm.submit(req)


def _scheduler_output(tm: TokenizerManager, rid: str, offset: int, ids: list[int], reason=None) -> None:
    out = M.Output(rid=rid, index=0, output_ids_offset=offset, new_token_ids=ids, finished=reason is not None,
                   finish_reason=reason, prompt_tokens=3, completion_tokens=offset + len(ids), cached_tokens=0,
                   completion_tokens_wo_jump_forward=offset + len(ids))
    tm._submit_in_order(tm._receive, M.encode(M.OutputBatch([out])))


async def _last_update(handle, timeout_s: float):
    last = None

    async def drain():
        nonlocal last
        async for update in handle.updates():
            last = update

    await asyncio.wait_for(drain(), timeout_s)
    return last


def test_abort_waits_for_the_schedulers_output():
    async def run():
        tm, handle = await _manager_with_request("waits", stream=False)
        assert await tm.abort("waits")
        assert isinstance(tm._send.sent[-1], M.AbortReq) and tm._send.sent[-1].rid == "waits"
        await asyncio.sleep(0.1)
        _scheduler_output(tm, "waits", 0, [0, 1, 2], {"type": "abort", "matched": None,
                                                      "message": "aborted by request"})
        last = await _last_update(handle, 5)
        await tm.release(handle)
        tm._detokenize_pool.shutdown()
        return last

    last = asyncio.run(run())
    assert last.text == "abc" and last.completion_tokens == 3
    assert last.choice.finish_reason["type"] == "abort"


@pytest.mark.parametrize("stream", [False, True])
def test_abort_ends_the_request_when_the_scheduler_does_not_answer(monkeypatch, stream):
    monkeypatch.setattr(tm_module, "ABORT_GRACE_S", 0.3)

    async def run():
        tm, handle = await _manager_with_request("silent", stream=stream)
        if stream:
            _scheduler_output(tm, "silent", 0, [3, 4])
        start = time.monotonic()
        assert await tm.abort("silent")
        last = await _last_update(handle, 5)
        waited = time.monotonic() - start
        await tm.release(handle)
        tm._detokenize_pool.shutdown()
        return last, waited

    last, waited = asyncio.run(run())
    assert 0.3 <= waited < 3
    assert last.finished and last.choice.finish_reason["type"] == "abort"
    assert last.text == ("de" if stream else "")
