"""The aiohttp application: the native API (/generate, health, info, tokenize, cache, adapters, metrics, the
dashboard) and the OpenAI routes. Start-up and shutdown are startup.py's; auth and error answers http_middleware.py's."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from aiohttp import web

from braid.runtime.core import Req
from braid.runtime.server import metrics as metrics_mod
from braid.runtime.server.chat_content import parse_template_messages
from braid.runtime.server.dashboard import dashboard_html
from braid.runtime.server.errors import APIError, bad_request, unavailable
from braid.runtime.server.generate_protocol import GenerateBody, parse_generate
from braid.runtime.server.http_middleware import (TM_KEY, auth_middleware, error_middleware, error_response,
                                                  json_response, read_json, resolve_api_key)
from braid.runtime.server.openai_api import OpenAIServing, template_messages
from braid.runtime.server.openai_protocol import ChatCompletionRequest, parse_openai
from braid.runtime.server.request_handle import RequestHandle, drain, merge_steps
from braid.runtime.server.sse import SSE_DONE, api_error_event, sse_event
from braid.runtime.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger("braid.server")

OPENAI_KEY = web.AppKey("openai_serving", OpenAIServing)


# ---- native API -------------------------------------------------------------------------------------


async def prepare_generate(tm: TokenizerManager, req: GenerateBody) -> list[Req]:
    """One prepared request per prompt of a /generate body (all checked before any is submitted)."""
    prompt_param = "text" if isinstance(req.prompts[0], str) else "input_ids"
    media_param = "video_data" if req.is_video else "image_data"
    param_names = {"prompt": prompt_param, "video_data": "image_data" if req.is_video else "video_data"}
    for prompt in req.prompts:  # all of a batch before any is tokenized
        if isinstance(prompt, str):
            tm.check_prompt_chars(len(prompt), prompt_param)
    return [await tm.prepare(prompt, sp, param_names=param_names, rid=req.rids[i] if req.rids else None,
                             return_logprob=req.return_logprob, logprob_start_len=req.logprob_start_len,
                             top_logprobs_num=req.top_logprobs_num, stream=req.stream,
                             lora_path=req.lora_paths[i] if req.lora_paths else None,
                             **({media_param: req.image_data[i]} if req.is_video else
                                {"image_data": req.image_data[i], "video_data": req.video_data[i]}))
            for i, (prompt, sp) in enumerate(zip(req.prompts, req.sampling_params))]


async def generate(request: web.Request) -> web.StreamResponse:
    tm = request.app[TM_KEY]
    tm.check_accepting()
    body = await read_json(request)
    req = parse_generate(body)
    token_text = tm.token_text if req.return_text_in_logprobs else None
    prepared = await prepare_generate(tm, req)
    handles: list[RequestHandle] = []
    try:
        for r in prepared:
            handles.append(await tm.submit(r, snapshot_ids=req.stream, client=request.remote))
        if req.stream:
            return await _stream_generate(request, handles, token_text)
        await drain(handles)
        results = [c.native_result(h.rid, token_text) for h in handles for c in h.choices]
        return json_response(results if (req.is_batch or len(results) > 1) else results[0])
    finally:
        for h in handles:
            await tm.release(h)


async def _stream_generate(request: web.Request, handles: list[RequestHandle], token_text) -> web.StreamResponse:
    steps = merge_steps(handles)
    first = await anext(steps, None)
    resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)

    def events(p: int, step: list) -> bytes:
        """One step's chunks of handle p, written together."""
        handle = handles[p]
        parts = []
        for u in step:
            chunk = u.choice.native_result(handle.rid, token_text, u)
            chunk["index"] = p * handle.n + u.index
            parts.append(sse_event(chunk))
        return b"".join(parts)

    try:
        if first is not None:
            await resp.write(events(*first))
        async for p, step in steps:
            data = events(p, step)
            if data:
                await resp.write(data)
    except APIError as e:
        await resp.write(api_error_event(e))
    await resp.write(SSE_DONE)
    await resp.write_eof()
    return resp


async def health(request: web.Request) -> web.Response:
    """200 while the server takes requests; 503 from the moment it drains or its scheduler died, until exit."""
    tm = request.app[TM_KEY]
    try:
        tm.check_accepting()
    except APIError as e:
        return error_response(e)
    return json_response({"status": "ok"})


async def health_generate(request: web.Request) -> web.Response:
    """Runs one real token through the model."""
    tm = request.app[TM_KEY]
    tm.check_accepting()
    handle = await tm.submit(await tm.prepare("Hi", {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}))
    try:
        await asyncio.wait_for(drain([handle]), 60)
    except asyncio.TimeoutError:
        return error_response(unavailable("health generation timed out"))
    finally:
        await tm.release(handle)
    c = handle.choices[0]
    if c.completion_tokens < 1 and not c.output_ids:
        return error_response(unavailable("health generation produced no token"))
    return json_response({"status": "ok", "output_ids": c.output_ids})


async def get_model_info(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    info = tm.served_model.public_info()
    info["tokenizer_path"] = tm.server_args.tokenizer_path or tm.server_args.model_path
    info["chat_template_content_format"] = tm.chat_content_format
    return json_response(info)


async def version(request: web.Request) -> web.Response:
    from braid import __version__

    return json_response({"version": __version__})


_TOKENIZE_KEYS = {"model", "prompt", "text", "messages", "add_special_tokens", "add_generation_prompt"}


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: {"prompt"} (SGLang: {"text"}) or {"messages"} -> {"tokens", "count", "max_model_len"}."""
    tm = request.app[TM_KEY]
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    unknown = sorted(set(body) - _TOKENIZE_KEYS)
    if unknown:
        raise bad_request(f"unknown parameter {unknown[0]!r}", param=unknown[0], code="unknown_parameter")
    request.app[OPENAI_KEY].check_model(body.get("model"))
    for name in ("add_special_tokens", "add_generation_prompt"):
        if not isinstance(body.get(name, True), bool):
            raise bad_request(f"{name} must be a boolean", param=name)
    given = [k for k in ("prompt", "text", "messages") if body.get(k) is not None]
    if len(given) != 1:
        raise bad_request("give exactly one of prompt (or text) and messages", param="prompt")
    if given[0] == "messages":
        chat = parse_openai(ChatCompletionRequest, {"messages": body["messages"]})
        messages, _ = template_messages(chat.messages)
        text = await tm.apply_chat_template(messages, add_generation_prompt=body.get("add_generation_prompt", True))
        add_special = body.get("add_special_tokens", False)
    else:
        text = body[given[0]]
        if not isinstance(text, str):
            raise bad_request(f"{given[0]} must be a string", param=given[0])
        tm.check_prompt_chars(len(text), given[0])
        add_special = body.get("add_special_tokens", True)
    ids = await tm.tokenize(text, add_special)
    return json_response({"tokens": ids, "count": len(ids), "max_model_len": tm.context_len})


async def apply_chat_template(request: web.Request) -> web.Response:
    """{"messages": as HF's apply_chat_template takes them (content parts {"type": "text" | "image" | "video"}),
    "add_generation_prompt"?} -> {"text": the prompt the chat routes build from them, "content_format"}: braid's
    runtime backends render a program's role blocks with the model's own template through it."""
    tm = request.app[TM_KEY]
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    unknown = sorted(set(body) - {"model", "messages", "add_generation_prompt"})
    if unknown:
        raise bad_request(f"unknown parameter {unknown[0]!r}", param=unknown[0], code="unknown_parameter")
    request.app[OPENAI_KEY].check_model(body.get("model"))
    if not isinstance(body.get("add_generation_prompt", True), bool):
        raise bad_request("add_generation_prompt must be a boolean", param="add_generation_prompt")
    text = await tm.apply_chat_template(parse_template_messages(body.get("messages")),
                                        add_generation_prompt=body.get("add_generation_prompt", True))
    return json_response({"text": text, "content_format": tm.chat_content_format})


async def detokenize(request: web.Request) -> web.Response:
    """{"tokens": [ids]} -> {"prompt": text} (vLLM) with the same text as "text" (SGLang)."""
    tm = request.app[TM_KEY]
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    unknown = sorted(set(body) - {"model", "tokens"})
    if unknown:
        raise bad_request(f"unknown parameter {unknown[0]!r}", param=unknown[0], code="unknown_parameter")
    request.app[OPENAI_KEY].check_model(body.get("model"))
    ids = body.get("tokens")
    if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise bad_request("tokens must be a list of token ids", param="tokens")
    if any(not 0 <= t < tm.vocab_size for t in ids):
        raise bad_request(f"tokens holds an id outside the vocabulary [0, {tm.vocab_size})", param="tokens")
    text = await tm.detokenize(ids)
    return json_response({"prompt": text, "text": text})


def _public_server_args(server_args) -> dict:
    d = dataclasses.asdict(server_args)
    if d.get("api_key"):
        d["api_key"] = "<redacted>"
    d["api_key_set"] = resolve_api_key(server_args) is not None
    return d


async def get_server_info(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    stats = await tm.get_stats()
    info = _public_server_args(tm.server_args)
    from braid import __version__

    info.update({"context_length": tm.context_len, "vocab_size": tm.vocab_size, "model_info": tm.model_info,
                 "num_server_requests": len(tm.handles), "version": __version__})
    info.update(stats)
    return json_response(info)


async def get_server_args(request: web.Request) -> web.Response:
    return json_response(_public_server_args(request.app[TM_KEY].server_args))


async def flush_cache(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    ok = await tm.flush_cache()
    if not ok:
        return json_response({"success": False, "message": "requests are running; cache not flushed"}, status=400)
    return json_response({"success": True, "message": "cache flushed"})


async def abort_request(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    body = await read_json(request)
    if not isinstance(body, dict) or not isinstance(body.get("rid"), str):
        raise bad_request("body must be an object with a string rid", param="rid")
    found = await tm.abort(body["rid"])
    return json_response({"success": found, "rid": body["rid"]}, status=200 if found else 404)


def _lora_body(body: Any, fields: tuple[str, ...]) -> tuple[str, ...]:
    """The string fields of a load / unload body (SGLang's and vLLM's: lora_name, lora_path)."""
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise bad_request(f"unknown parameter {unknown[0]!r}; this route takes {', '.join(fields)}", param=unknown[0],
                          code="unknown_parameter")
    for name in fields:
        value = body.get(name)
        if not isinstance(value, str) or not value:
            raise bad_request(f"{name} must be a non-empty string", param=name)
    return tuple(body[name] for name in fields)


async def load_lora_adapter(request: web.Request) -> web.Response:
    """SGLang's /load_lora_adapter and vLLM's /v1/load_lora_adapter: {"lora_name", "lora_path"}; 200 once the
    adapter is registered (checked against the model), else 400 naming what is wrong."""
    tm = request.app[TM_KEY]
    name, path = _lora_body(await read_json(request), ("lora_name", "lora_path"))
    if name in (tm.server_args.model_name, tm.server_args.model_path, "default"):
        raise bad_request(f"lora_name {name!r} is the served model's name", param="lora_name", code="lora_invalid")
    loaded = await tm.load_lora_adapter(name, path)
    return json_response({"success": True, "message": f"LoRA adapter {name!r} loaded from {path}",
                          "loaded_adapters": loaded})


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """SGLang's /unload_lora_adapter and vLLM's /v1/unload_lora_adapter: {"lora_name"}; new requests naming it get
    400 at once, and the answer comes once the requests already on it have finished and it is gone."""
    tm = request.app[TM_KEY]
    (name,) = _lora_body(await read_json(request), ("lora_name",))
    loaded = await tm.unload_lora_adapter(name)
    return json_response({"success": True, "message": f"LoRA adapter {name!r} unloaded", "loaded_adapters": loaded})


async def dashboard(request: web.Request) -> web.Response:
    return web.Response(text=dashboard_html(), content_type="text/html")


async def metrics(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    stats = None if tm.dead else await tm.get_stats()
    return web.Response(body=tm.metrics.render(stats), headers={"Content-Type": metrics_mod.CONTENT_TYPE})


# ---- OpenAI routes --------------------------------------------------------------------------------------


async def v1_models(request: web.Request) -> web.Response:
    return json_response(request.app[OPENAI_KEY].models())


async def v1_completions(request: web.Request) -> web.StreamResponse:
    request.app[TM_KEY].check_accepting()
    return await request.app[OPENAI_KEY].completions(request, await read_json(request))


async def v1_chat_completions(request: web.Request) -> web.StreamResponse:
    request.app[TM_KEY].check_accepting()
    return await request.app[OPENAI_KEY].chat_completions(request, await read_json(request))


def create_app(tm: TokenizerManager) -> web.Application:
    args = tm.server_args
    middlewares = [error_middleware]
    api_key = resolve_api_key(args)
    if api_key:
        middlewares.append(auth_middleware(api_key))
    # +1: aiohttp rejects at >= client_max_size; read_json answers 413 with an error object
    app = web.Application(middlewares=middlewares, client_max_size=args.max_body_bytes + 1)
    app[TM_KEY] = tm
    app[OPENAI_KEY] = OpenAIServing(tm)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/get_model_info", get_model_info)
    app.router.add_get("/version", version)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_post("/apply_chat_template", apply_chat_template)
    app.router.add_get("/get_server_info", get_server_info)
    app.router.add_get("/get_server_args", get_server_args)
    app.router.add_route("GET", "/flush_cache", flush_cache)  # SGLang v0.3 flushes on GET
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/dashboard", dashboard)
    app.router.add_post("/generate", generate)
    app.router.add_get("/v1/models", v1_models)
    for prefix in ("", "/v1"):
        app.router.add_post(f"{prefix}/load_lora_adapter", load_lora_adapter)
        app.router.add_post(f"{prefix}/unload_lora_adapter", unload_lora_adapter)
    app.router.add_post("/v1/completions", v1_completions)
    app.router.add_post("/v1/chat/completions", v1_chat_completions)
    return app
