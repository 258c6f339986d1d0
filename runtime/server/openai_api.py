"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import json
import time
from typing import Any, Optional

from aiohttp import web

from braid.runtime.core import Req
from braid.runtime.sampling_params import GRAMMAR_FIELDS
from braid.runtime.server.chat_content import count_placeholders, template_messages
from braid.runtime.server.errors import APIError, bad_request, model_not_found
from braid.runtime.request_io.output_accumulator import OutputAccumulator
from braid.runtime.server.generate_protocol import request_ids
from braid.runtime.server.openai_constraints import GrammarServing, constraint_param
from braid.runtime.server.openai_protocol import (ChatCompletionRequest, CompletionRequest, LogprobPlan,
                                                  chat_logprob_options, chat_template_options,
                                                  completion_logprob_options, openai_sampling_overrides, parse_openai,
                                                  requested_n)
from braid.runtime.server.sse import SSE_DONE, TextChunkTemplate, api_error_event, json_bytes, sse_event
from braid.runtime.server.request_handle import RequestHandle, drain, merge_steps
from braid.runtime.server.tokenizer_manager import TokenizerManager
from braid.runtime.server.tools import (ToolPlan, ToolStream, history_for_template, parse_auto, parse_constrained,
                                        plan_tools, template_knows_tools, template_refuses_system)


def finish_reason_name(reason: Optional[dict]) -> Optional[str]:
    if reason is None:
        return None
    kind = reason.get("type")
    return kind if kind in ("stop", "length") else "abort"


def matched_stop(reason: Optional[dict]) -> Any:
    return None if reason is None else reason.get("matched")


def _param_names(req, prompt_param: str) -> dict:
    """prepare_request's parameter names -> the names this OpenAI request used."""
    max_param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
    names = {"prompt": prompt_param, "max_new_tokens": max_param, "min_new_tokens": "min_tokens",
             "image_data": prompt_param, "video_data": prompt_param, "audio_data": prompt_param}
    source = constraint_param(req)
    if source is not None:
        names.update(dict.fromkeys(GRAMMAR_FIELDS, source))
    if "include_stop_str_in_output" in req.extras():
        names["no_stop_trim"] = "include_stop_str_in_output"
    return names


def _rename_constraint(err: APIError, req, source: Optional[str] = None) -> None:
    """A grammar error found after translation (e.g. by the grammar compiler) names what the client sent (`source`:
    that name when it is no constraint parameter, e.g. "tools")."""
    source = source or constraint_param(req)
    if err.param in GRAMMAR_FIELDS and source is not None:
        err.param = source


async def _write(resp: web.StreamResponse, data: bytes) -> None:
    if data:  # a step whose text is all held back (a possible stop string) sends nothing
        await resp.write(data)


def _json_response(body: dict) -> web.Response:
    return web.Response(body=json_bytes(body), content_type="application/json")


class OpenAIServing:
    def __init__(self, tm: TokenizerManager):
        self.tm = tm
        args = tm.server_args
        self.grammar_serving = GrammarServing(fallback=args.grammar_backend == "auto",
                                              json_strict=args.grammar_json_strict)
        self._token_text: dict[int, str] = {}
        self._started = time.time()

    @property
    def model_name(self) -> str:
        return self.tm.server_args.model_name

    def check_model(self, model: Optional[str]) -> tuple[str, Optional[str]]:
        """model -> (the name answers carry, the LoRA adapter it selects or None). An adapter is named alone
        ("sql") or after the base model ("base:sql"), as in vLLM and SGLang; answers then carry the name given."""
        names = {self.model_name, self.tm.server_args.model_path, "default"}  # "default": SGLang's any-model name
        if model is None or model in names:
            return self.model_name, None
        adapters = self.tm.lora_adapters
        base, sep, adapter = model.rpartition(":")
        if model in adapters:
            return model, model
        if sep and base in names and adapter in adapters:
            return model, adapter
        raise model_not_found(model)

    def models(self) -> dict:
        adapters = [{"id": name, "object": "model", "created": int(self._started), "owned_by": "braid", "root": path,
                     "parent": self.model_name} for name, path in self.tm.lora_adapters.items()]
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": int(self._started),
                                            "owned_by": "braid", "root": self.tm.server_args.model_path,
                                            "max_model_len": self.tm.context_len}, *adapters]}

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
            if lp is None:  # the first prompt token (echo) has no logprob
                tops.append(None)
                continue
            # the top want_top alternatives and, like OpenAI and vLLM (logprobs=0 included), the sampled token
            entry = {self.token_text(t): l for l, t in (top or [])[:want_top]}
            entry.setdefault(tok, lp)
            tops.append(entry)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    @staticmethod
    def _usage(handles: list[RequestHandle]) -> dict:
        prompt = sum(len(h.prompt_ids) for h in handles)
        completion = sum(c.completion_tokens for h in handles for c in h.choices)
        cached = sum(max((c.cached_tokens for c in h.choices), default=0) for h in handles)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    @staticmethod
    def _chunk_usage(u, completion: bool = True) -> dict:
        """continuous_usage_stats: a chunk's usage is its choice's as of the update (as vLLM counts it);
        `completion=False` for a role chunk, which precedes the choice's tokens."""
        done = u.completion_tokens if completion else 0
        return {"prompt_tokens": u.prompt_tokens, "completion_tokens": done, "total_tokens": u.prompt_tokens + done,
                "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}

    async def _open_stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                       "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        return resp

    def _ranked(self, choices: list[OutputAccumulator], n: int) -> list[tuple[int, OutputAccumulator]]:
        """(index, choice) of the n choices returned: all of them, or with best_of the n of highest cumulative
        logprob."""
        if len(choices) <= n:
            return list(enumerate(choices))
        best = sorted(choices, key=lambda c: sum(lp for lp, _ in c.output_token_logprobs), reverse=True)[:n]
        return list(enumerate(best))

    def _prompt_logprobs(self, c: OutputAccumulator, k: int) -> list:
        """vLLM's prompt_logprobs: None for the first token, then {token id: {logprob, rank, decoded_token}} holding
        the prompt's token and the k most likely ones (rank None when the token is not among the top)."""
        out: list = []
        tops_all = c.input_top_logprobs or []
        for j, (lp, tid) in enumerate(c.input_token_logprobs or []):
            if lp is None:
                out.append(None)
                continue
            tops = (tops_all[j] if j < len(tops_all) else None) or []
            ranked = [t for _, t in tops]
            entry = {str(tid): {"logprob": lp, "rank": ranked.index(tid) + 1 if tid in ranked else None,
                                "decoded_token": self.token_text(tid)}}
            for r, (l, t) in enumerate(tops[:k]):
                entry.setdefault(str(t), {"logprob": l, "rank": r + 1, "decoded_token": self.token_text(t)})
            out.append(entry)
        return out

    # ---- chat ---------------------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request, body: Any) -> web.StreamResponse:
        req = parse_openai(ChatCompletionRequest, body)
        model, lora_path = self.check_model(req.model)
        output_lp, top_n = chat_logprob_options(req)
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        messages, media = template_messages(req.messages)
        overrides = openai_sampling_overrides(req, self.grammar_serving)
        if plan is not None and plan.constrained:
            given = [f for f in GRAMMAR_FIELDS if overrides.get(f) is not None]
            if given:
                raise bad_request(f"tool_choice {plan.choice!r} constrains the output to a tool call; it cannot be "
                                  f"combined with {constraint_param(req) or given[0]}", param="tool_choice")
            overrides["json_schema"] = json.dumps(plan.call_schema())
        source = "tools" if plan is not None and plan.constrained else None
        n = requested_n(req)
        lps = LogprobPlan(output_lp, top_n, req.prompt_logprobs, rank=(req.best_of or n) > n)
        self.tm.check_admission()  # before the chat template's work
        chat_template = getattr(self.tm.tokenizer, "chat_template", None)
        native_tools = template_knows_tools(chat_template)
        messages = history_for_template(messages, req.messages, plan, native_tools,
                                        system_role=not template_refuses_system(chat_template))
        tools = ([{"type": "function", "function": f} for f in plan.functions]
                 if plan is not None and native_tools and plan.choice != "none" else None)
        prompt = await self.tm.apply_chat_template(messages, tools=tools, **chat_template_options(req))
        self._check_placeholders(prompt, media)
        names = _param_names(req, "messages")
        if source is not None:
            names.update(dict.fromkeys(GRAMMAR_FIELDS, source))
        prepared = await self.tm.prepare(prompt, overrides, param_names=names, rid=req.rid,
                                         prompt_chars_checked=True, stream=req.stream,
                                         add_special_tokens=bool(req.add_special_tokens),
                                         max_new_tokens_fills_context=True, lora_path=lora_path,
                                         **lps.prepare_options(), **media)
        handle = await self.tm.submit(prepared, returned_n=n, client=request.remote)
        try:
            rid = f"chatcmpl-{handle.rid}"
            if req.stream:
                return await self._stream_chat(request, handle, rid, model, req, lps, plan, source)
            await drain([handle])
            choices = []
            for index, c in self._ranked(handle.choices, n):
                message: dict = {"role": "assistant", "content": c.text}
                finish = finish_reason_name(c.finish_reason)
                if plan is not None and plan.parses:
                    content, calls = self._tool_calls(plan, c.text)
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    if calls and finish == "stop":
                        finish = "tool_calls"
                choices.append({
                    "index": index,
                    "message": message,
                    "logprobs": {"content": self._chat_logprobs(c.output_token_logprobs, c.output_top_logprobs, top_n)}
                    if output_lp else None,
                    "finish_reason": finish,
                    "matched_stop": matched_stop(c.finish_reason),
                })
            out = {"id": rid, "object": "chat.completion", "created": int(handle.created), "model": model,
                   "choices": choices, "usage": self._usage([handle])}
            if req.prompt_logprobs is not None:
                out["prompt_logprobs"] = self._prompt_logprobs(handle.choices[0], req.prompt_logprobs)
            return _json_response(out)
        except APIError as e:
            _rename_constraint(e, req, source)
            raise
        finally:
            await self.tm.release(handle)

    def _check_placeholders(self, prompt: str, media: dict[str, list]) -> None:
        """On a vision model, each image / video part needs its placeholder in the templated prompt (the pixels go
        there); a text model's prompt is text, and media parts sent to it are refused by prepare_request."""
        if not self.tm.served_model.is_multimodal:
            return
        rendered = count_placeholders(prompt)
        for param, kind in (("image_data", "image"), ("video_data", "video")):
            given = len(media.get(param, []))
            if rendered[param] != given:
                raise bad_request(
                    f"the chat template rendered {rendered[param]} <{kind}> placeholder(s) for {given} {kind} "
                    f"part(s) (chat template content format {self.tm.chat_content_format!r}; see "
                    "--chat-template-content-format)", param="messages")

    @staticmethod
    def _tool_calls(plan: ToolPlan, text: str) -> tuple[Optional[str], list[dict]]:
        if plan.constrained:
            call = parse_constrained(text)
            return (None, [call]) if call is not None else (text, [])
        return parse_auto(text, plan)

    async def _stream_chat(self, request, handle: RequestHandle, rid: str, model: str, req: ChatCompletionRequest,
                           lps: LogprobPlan, plan: Optional[ToolPlan], source: Optional[str]) -> web.StreamResponse:
        steps = handle.steps()
        first = await anext(steps, None)  # a rejected request is still answered with its status code
        resp = await self._open_stream(request)
        created = int(handle.created)
        include_usage, continuous_usage = req.include_usage, req.continuous_usage
        text_only = TextChunkTemplate(rid, "chat.completion.chunk", created, model, chat=True,
                                      usage_null=include_usage and not continuous_usage)
        tool_streams: dict[int, ToolStream] = {}

        def chunk(u, delta: dict, logprobs=None, finish=None, matched=None, role=False) -> dict:
            choice = {"index": u.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            if finish is not None:
                choice["matched_stop"] = matched
            c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
            if include_usage:
                c["usage"] = self._chunk_usage(u, completion=not role) if continuous_usage else None
            return c

        started: set[int] = set()

        def events(u, parts: list) -> None:
            if u.index not in started:
                started.add(u.index)
                first_chunk = chunk(u, {"role": "assistant", "content": ""}, role=True)
                if req.prompt_logprobs is not None and len(started) == 1:
                    first_chunk["prompt_logprobs"] = self._prompt_logprobs(u.choice, req.prompt_logprobs)
                parts.append(sse_event(first_chunk))
            lp = None
            if lps.output and u.new_token_logprobs:
                lp = {"content": self._chat_logprobs(u.new_token_logprobs, u.new_top_logprobs, lps.top_n)}
            if plan is not None and plan.parses:
                ts = tool_streams.setdefault(u.index, ToolStream(plan))
                deltas = ts.feed(u.delta, u.finished)
            else:
                if u.delta and lp is None and not u.finished and not continuous_usage:
                    parts.append(text_only.chunk(u.index, u.delta))
                    return
                ts, deltas = None, [{"content": u.delta}] if u.delta else []
            if not deltas and (lp is not None or u.finished):
                deltas = [{}]
            reason = u.choice.finish_reason if u.finished else None
            finish = finish_reason_name(reason)
            if ts is not None and ts.num_calls and finish == "stop":
                finish = "tool_calls"
            for j, delta in enumerate(deltas):
                last = j == len(deltas) - 1
                parts.append(sse_event(chunk(u, delta, lp if j == 0 else None, finish if last else None,
                                             matched_stop(reason))))

        def step_events(step: list) -> bytes:
            parts: list[bytes] = []
            for u in step:
                events(u, parts)
            return b"".join(parts)

        try:
            for step in ([first] if first is not None else []):
                await _write(resp, step_events(step))
            async for step in steps:
                await _write(resp, step_events(step))
        except APIError as e:
            _rename_constraint(e, req, source)
            await resp.write(api_error_event(e))
        else:
            if include_usage:
                await resp.write(sse_event({"id": rid, "object": "chat.completion.chunk", "created": created,
                                            "model": model, "choices": [], "usage": self._usage([handle])}))
        await resp.write(SSE_DONE)
        await resp.write_eof()
        return resp

    # ---- completions ---------------------------------------------------------------------------------
    async def _completion_prompts(self, req: CompletionRequest, lps: LogprobPlan, overrides: dict,
                                  lora_path: Optional[str]) -> list[tuple[Req, str]]:
        """[(prepared request, prompt text)] for each prompt of the request."""
        prompt = req.prompt
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt)):
            prompts: list = [prompt]
        elif isinstance(prompt, list) and prompt:
            prompts = prompt
        else:
            raise bad_request("prompt must be a non-empty string, list of strings, or token ids", param="prompt")
        for p in prompts:  # all before any is tokenized
            if isinstance(p, str):
                self.tm.check_prompt_chars(len(p), "prompt")
        rids = request_ids(req.rid, len(prompts))
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        out = []
        for i, p in enumerate(prompts):
            prepared = await self.tm.prepare(p, overrides, param_names=_param_names(req, "prompt"),
                                             rid=rids[i] if rids else None, stream=req.stream,
                                             add_special_tokens=add_special, max_new_tokens_fills_context=True,
                                             lora_path=lora_path, **lps.prepare_options())
            out.append((prepared, p if isinstance(p, str) else await self.tm.detokenize(p)))
        return out

    async def completions(self, request: web.Request, body: Any) -> web.StreamResponse:
        req = parse_openai(CompletionRequest, body)
        model, lora_path = self.check_model(req.model)
        output_lp, top_n = completion_logprob_options(req)
        overrides = openai_sampling_overrides(req, self.grammar_serving)
        n = requested_n(req)
        lps = LogprobPlan(output_lp, top_n, req.prompt_logprobs, rank=(req.best_of or n) > n, echo=req.echo)
        prompts = await self._completion_prompts(req, lps, overrides, lora_path)
        handles: list[RequestHandle] = []
        try:
            for prepared, _ in prompts:
                handles.append(await self.tm.submit(prepared, returned_n=n, client=request.remote))
            rid = f"cmpl-{handles[0].rid}"
            if req.stream:
                return await self._stream_completion(request, handles, prompts, rid, model, req, lps, n)
            await drain(handles)
            choices = []
            for p, (h, (_, prompt_text)) in enumerate(zip(handles, prompts)):
                for index, c in self._ranked(h.choices, n):
                    choice = self._completion_choice(p * n + index, c, prompt_text, req.echo, output_lp, top_n)
                    if req.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = self._prompt_logprobs(c, req.prompt_logprobs)
                    choices.append(choice)
            return _json_response({"id": rid, "object": "text_completion", "created": int(handles[0].created),
                                   "model": model, "choices": choices, "usage": self._usage(handles)})
        except APIError as e:
            _rename_constraint(e, req)
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

    async def _stream_completion(self, request, handles, prompts, rid, model, req: CompletionRequest,
                                 lps: LogprobPlan, n: int) -> web.StreamResponse:
        steps = merge_steps(handles)
        first = await anext(steps, None)
        resp = await self._open_stream(request)
        created = int(handles[0].created)
        include_usage, continuous_usage = req.include_usage, req.continuous_usage
        text_only = TextChunkTemplate(rid, "text_completion", created, model, chat=False,
                                      usage_null=include_usage and not continuous_usage)
        started: set[int] = set()
        offsets: dict[int, int] = {}

        def events(p: int, u, parts: list) -> None:
            index = p * n + u.index
            text = u.delta
            first_chunk = index not in started
            if not first_chunk and not lps.output and not u.finished and not continuous_usage:
                if text:
                    parts.append(text_only.chunk(index, text))
                return
            token_lps, top_lps = list(u.new_token_logprobs), list(u.new_top_logprobs)
            if first_chunk:
                started.add(index)
                if req.echo:
                    text = prompts[p][1] + text
                    c = u.choice
                    if lps.output and c.input_token_logprobs is not None:
                        token_lps = list(c.input_token_logprobs) + token_lps
                        top_lps = list(c.input_top_logprobs or [None] * len(c.input_token_logprobs)) + top_lps
            lp = None
            if lps.output and token_lps:
                lp = self._completion_logprobs(token_lps, top_lps, lps.top_n, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + sum(len(t) for t in lp["tokens"])
            if text or lp is not None or u.finished or first_chunk:
                reason = u.choice.finish_reason if u.finished else None
                choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason_name(reason)}
                if reason is not None:
                    choice["matched_stop"] = matched_stop(reason)
                if first_chunk and req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs(u.choice, req.prompt_logprobs)
                c = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
                if include_usage:
                    c["usage"] = self._chunk_usage(u) if continuous_usage else None
                parts.append(sse_event(c))

        def step_events(p: int, step: list) -> bytes:
            parts: list[bytes] = []
            for u in step:
                events(p, u, parts)
            return b"".join(parts)

        try:
            if first is not None:
                await _write(resp, step_events(*first))
            async for p, step in steps:
                await _write(resp, step_events(p, step))
        except APIError as e:
            _rename_constraint(e, req)
            await resp.write(api_error_event(e))
        else:
            if include_usage:
                await resp.write(sse_event({"id": rid, "object": "text_completion", "created": created, "model": model,
                                            "choices": [], "usage": self._usage(handles)}))
        await resp.write(SSE_DONE)
        await resp.write_eof()
        return resp
