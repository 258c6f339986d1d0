"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import time
from typing import Any, Optional

from aiohttp import web

from braid.runtime.core import Req
from braid.runtime.server.errors import APIError, bad_request, model_not_found
from braid.runtime.server.output_accumulator import OutputAccumulator
from braid.runtime.server.protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    api_error_event,
    chat_logprob_options,
    check_chat_supported,
    check_completion_supported,
    completion_logprob_options,
    json_bytes,
    openai_sampling_overrides,
    parse_openai,
    sse_event,
)
from braid.runtime.server.request_handle import RequestHandle, merge_updates
from braid.runtime.server.tokenizer_manager import TokenizerManager


def finish_reason_name(reason: Optional[dict]) -> Optional[str]:
    if reason is None:
        return None
    kind = reason.get("type")
    return kind if kind in ("stop", "length") else "abort"


def matched_stop(reason: Optional[dict]) -> Any:
    return None if reason is None else reason.get("matched")


# content part type -> (its payload key, prepare_request's keyword)
_MEDIA_PARTS = {"image_url": ("image_url", "image_data"), "video_url": ("video_url", "video_data"),
                "input_audio": ("input_audio", "audio_data")}


def template_messages(messages: list[ChatMessage]) -> tuple[list[dict], dict[str, list]]:
    """Messages as the chat template wants them (text content), and the media their parts carry as
    {"image_data" | "video_data" | "audio_data": [payload, ...]}."""
    out: list[dict] = []
    media: dict[str, list] = {}
    for i, m in enumerate(messages):
        content = m.content
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            pieces = []
            for part in content:
                kind = part.get("type")
                if kind == "text" and isinstance(part.get("text"), str):
                    pieces.append(part["text"])
                elif kind in _MEDIA_PARTS and isinstance(part.get(_MEDIA_PARTS[kind][0]), dict):
                    payload = part[_MEDIA_PARTS[kind][0]]
                    media.setdefault(_MEDIA_PARTS[kind][1], []).append(payload.get("url", payload))
                else:
                    raise bad_request(f"messages[{i}].content: unsupported content part {kind!r}",
                                      param=f"messages.{i}.content")
            text = "".join(pieces)
        d = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.name:
            d["name"] = m.name
        out.append(d)
    return out, media


def _param_names(req, prompt_param: str) -> dict:
    """prepare_request's parameter names -> the names this OpenAI request used."""
    max_param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
    return {"prompt": prompt_param, "max_new_tokens": max_param, "min_new_tokens": "min_tokens",
            "image_data": prompt_param, "video_data": prompt_param, "audio_data": prompt_param}


def _rename_response_format(err: APIError, req) -> None:
    if err.param == "json_schema" and req.response_format is not None:
        err.param = "response_format"  # the name the client used


def _json_response(body: dict) -> web.Response:
    return web.Response(body=json_bytes(body), content_type="application/json")


class OpenAIServing:
    def __init__(self, tm: TokenizerManager):
        self.tm = tm
        self._token_text: dict[int, str] = {}
        self._started = time.time()

    @property
    def model_name(self) -> str:
        return self.tm.server_args.model_name

    def check_model(self, model: Optional[str]) -> str:
        names = {self.model_name, self.tm.server_args.model_path, "default"}  # "default": SGLang's any-model name
        if model is not None and model not in names:
            raise model_not_found(model)
        return self.model_name

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": int(self._started),
                                            "owned_by": "braid", "root": self.tm.server_args.model_path,
                                            "max_model_len": self.tm.context_len}]}

    # ---- helpers -------------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        t = self._token_text.get(token_id)
        if t is None:
            t = self.tm.token_text(token_id)
            if len(self._token_text) < 200_000:
                self._token_text[token_id] = t
        return t

    def _chat_logprobs(self, token_logprobs: list, top_logprobs: list, want_top: int) -> list:
        entries = []
        for j, (lp, tid) in enumerate(token_logprobs):
            tok = self.token_text(tid)
            entry = {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")), "top_logprobs": []}
            tops = top_logprobs[j] if j < len(top_logprobs) else None
            if want_top and tops:
                entry["top_logprobs"] = [{"token": self.token_text(t), "logprob": l,
                                          "bytes": list(self.token_text(t).encode("utf-8"))} for l, t in tops[:want_top]]
            entries.append(entry)
        return entries

    def _completion_logprobs(self, token_logprobs: list, top_logprobs: list, want_top: int, text_offset: int) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        for j, (lp, tid) in enumerate(token_logprobs):
            tok = self.token_text(tid)
            tokens.append(tok)
            lps.append(lp)
            offsets.append(text_offset)
            text_offset += len(tok)
            top = top_logprobs[j] if j < len(top_logprobs) else None
            tops.append({self.token_text(t): l for l, t in (top or [])[:want_top]} if want_top and top else None)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    @staticmethod
    def _usage(handles: list[RequestHandle]) -> dict:
        prompt = sum(len(h.prompt_ids) for h in handles)
        completion = sum(c.completion_tokens for h in handles for c in h.choices)
        cached = sum(max((c.cached_tokens for c in h.choices), default=0) for h in handles)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def _open_stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                       "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        return resp

    # ---- chat ---------------------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request, body: Any) -> web.StreamResponse:
        req = parse_openai(ChatCompletionRequest, body)
        model = self.check_model(req.model)
        check_chat_supported(req)
        return_logprob, top_n = chat_logprob_options(req)
        messages, media = template_messages(req.messages)
        overrides = openai_sampling_overrides(req)
        self.tm.check_admission()  # before the chat template's work
        prompt = await self.tm.apply_chat_template(messages)
        prepared = await self.tm.prepare(prompt, overrides, param_names=_param_names(req, "messages"), rid=req.rid,
                                         prompt_chars_checked=True, return_logprob=return_logprob,
                                         top_logprobs_num=top_n, stream=req.stream, add_special_tokens=False,
                                         max_new_tokens_fills_context=True, **media)
        handle = await self.tm.submit(prepared)
        try:
            rid = f"chatcmpl-{handle.rid}"
            if req.stream:
                return await self._stream_chat(request, handle, rid, model, req.include_usage, return_logprob, top_n)
            async for _ in handle.updates():
                pass
            choices = []
            for c in handle.choices:
                choices.append({
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": {"content": self._chat_logprobs(c.output_token_logprobs, c.output_top_logprobs, top_n)}
                    if return_logprob else None,
                    "finish_reason": finish_reason_name(c.finish_reason),
                    "matched_stop": matched_stop(c.finish_reason),
                })
            return _json_response({"id": rid, "object": "chat.completion", "created": int(handle.created),
                                   "model": model, "choices": choices, "usage": self._usage([handle])})
        except APIError as e:
            _rename_response_format(e, req)
            raise
        finally:
            await self.tm.release(handle)

    async def _stream_chat(self, request, handle: RequestHandle, rid: str, model: str, include_usage: bool,
                           return_logprob: bool, top_n: int) -> web.StreamResponse:
        updates = handle.updates()
        first = await anext(updates, None)  # a rejected request is still answered with its status code
        resp = await self._open_stream(request)
        created = int(handle.created)

        def chunk(index: int, delta: dict, logprobs=None, finish=None, matched=None) -> dict:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            if finish is not None:
                choice["matched_stop"] = matched
            c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
            if include_usage:
                c["usage"] = None
            return c

        started: set[int] = set()

        async def emit(u) -> None:
            if u.index not in started:
                started.add(u.index)
                await resp.write(sse_event(chunk(u.index, {"role": "assistant", "content": ""})))
            lp = None
            if return_logprob and u.new_token_logprobs:
                lp = {"content": self._chat_logprobs(u.new_token_logprobs, u.new_top_logprobs, top_n)}
            if u.delta or lp is not None or u.finished:
                reason = u.choice.finish_reason if u.finished else None
                await resp.write(sse_event(chunk(u.index, {"content": u.delta} if u.delta else {}, lp,
                                                 finish_reason_name(reason), matched_stop(reason))))

        try:
            if first is not None:
                await emit(first)
            async for u in updates:
                await emit(u)
        except APIError as e:
            await resp.write(api_error_event(e))
        else:
            if include_usage:
                await resp.write(sse_event({"id": rid, "object": "chat.completion.chunk", "created": created,
                                            "model": model, "choices": [], "usage": self._usage([handle])}))
        await resp.write(SSE_DONE)
        await resp.write_eof()
        return resp

    # ---- completions ---------------------------------------------------------------------------------
    async def _completion_prompts(self, req: CompletionRequest, return_logprob: bool,
                                  top_n: int) -> list[tuple[Req, str]]:
        """[(prepared request, prompt text)] for each prompt of the request."""
        prompt = req.prompt
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt)):
            prompts: list = [prompt]
        elif isinstance(prompt, list) and prompt:
            prompts = prompt
        else:
            raise bad_request("prompt must be a non-empty string, list of strings, or token ids", param="prompt")
        overrides = openai_sampling_overrides(req)
        logprob_start_len = 0 if (req.echo and return_logprob) else -1
        for p in prompts:  # all before any is tokenized
            if isinstance(p, str):
                self.tm.check_prompt_chars(len(p), "prompt")
        out = []
        for p in prompts:
            prepared = await self.tm.prepare(p, overrides, param_names=_param_names(req, "prompt"),
                                             rid=req.rid if len(prompts) == 1 else None, return_logprob=return_logprob,
                                             logprob_start_len=logprob_start_len, top_logprobs_num=top_n,
                                             stream=req.stream, max_new_tokens_fills_context=True)
            out.append((prepared, p if isinstance(p, str) else self.tm.tokenizer.decode(p)))
        return out

    async def completions(self, request: web.Request, body: Any) -> web.StreamResponse:
        req = parse_openai(CompletionRequest, body)
        model = self.check_model(req.model)
        check_completion_supported(req)
        return_logprob, top_n = completion_logprob_options(req)
        prompts = await self._completion_prompts(req, return_logprob, top_n)
        handles: list[RequestHandle] = []
        try:
            for prepared, _ in prompts:
                handles.append(await self.tm.submit(prepared))
            rid = f"cmpl-{handles[0].rid}"
            n = handles[0].n
            if req.stream:
                return await self._stream_completion(request, handles, prompts, rid, model, req, return_logprob, top_n, n)
            async for _ in merge_updates(handles):
                pass
            choices = []
            for p, (h, (_, prompt_text)) in enumerate(zip(handles, prompts)):
                for c in h.choices:
                    choices.append(self._completion_choice(p * n + c.index, c, prompt_text, req.echo, return_logprob, top_n))
            return _json_response({"id": rid, "object": "text_completion", "created": int(handles[0].created),
                                   "model": model, "choices": choices, "usage": self._usage(handles)})
        except APIError as e:
            _rename_response_format(e, req)
            raise
        finally:
            for h in handles:
                await self.tm.release(h)

    def _completion_choice(self, index: int, c: OutputAccumulator, prompt_text: str, echo: bool, return_logprob: bool,
                           top_n: int) -> dict:
        text = (prompt_text + c.text) if echo else c.text
        logprobs = None
        if return_logprob:
            token_lps, top_lps = list(c.output_token_logprobs), list(c.output_top_logprobs)
            if echo and c.input_token_logprobs is not None:
                token_lps = list(c.input_token_logprobs) + token_lps
                top_lps = list(c.input_top_logprobs or [None] * len(c.input_token_logprobs)) + top_lps
            logprobs = self._completion_logprobs(token_lps, top_lps, top_n, 0)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason_name(c.finish_reason),
                "matched_stop": matched_stop(c.finish_reason)}

    async def _stream_completion(self, request, handles, prompts, rid, model, req, return_logprob, top_n,
                                 n) -> web.StreamResponse:
        updates = merge_updates(handles)
        first = await anext(updates, None)
        resp = await self._open_stream(request)
        created = int(handles[0].created)
        started: set[int] = set()
        offsets: dict[int, int] = {}

        async def emit(p: int, u) -> None:
            index = p * n + u.index
            text = u.delta
            token_lps, top_lps = list(u.new_token_logprobs), list(u.new_top_logprobs)
            if index not in started:
                started.add(index)
                if req.echo:
                    text = prompts[p][1] + text
                    c = u.choice
                    if return_logprob and c.input_token_logprobs is not None:
                        token_lps = list(c.input_token_logprobs) + token_lps
                        top_lps = list(c.input_top_logprobs or [None] * len(c.input_token_logprobs)) + top_lps
            lp = None
            if return_logprob and token_lps:
                lp = self._completion_logprobs(token_lps, top_lps, top_n, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + sum(len(t) for t in lp["tokens"])
            if text or lp is not None or u.finished:
                reason = u.choice.finish_reason if u.finished else None
                choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason_name(reason)}
                if reason is not None:
                    choice["matched_stop"] = matched_stop(reason)
                c = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
                if req.include_usage:
                    c["usage"] = None
                await resp.write(sse_event(c))

        try:
            if first is not None:
                await emit(*first)
            async for p, u in updates:
                await emit(p, u)
        except APIError as e:
            await resp.write(api_error_event(e))
        else:
            if req.include_usage:
                await resp.write(sse_event({"id": rid, "object": "text_completion", "created": created, "model": model,
                                            "choices": [], "usage": self._usage(handles)}))
        await resp.write(SSE_DONE)
        await resp.write_eof()
        return resp
