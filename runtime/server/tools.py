"""Tool calling on /v1/chat/completions: tool definitions into the prompt, tool calls out of the model's text.

A chat template that knows tools (it reads a `tools` variable) renders them itself. For one that does not (SmolLM2's),
braid adds a system message describing the tools and asking for calls written as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes/Qwen format), and renders earlier calls and
tool results in that format. `tool_choice` "required" or a named function constrains the output to one call's JSON
(`{"name": ..., "arguments": ...}` with the function's parameter schema), so the call always parses and validates;
"auto" parses `<tool_call>` blocks when the model writes them; "none" leaves the tools out of the prompt.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from braid.runtime.chat_format import content_text
from braid.runtime.server.chat_content import add_text
from braid.runtime.server.errors import bad_request

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CALL_BLOCK = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)

_SYSTEM_PROMPT = ("You can call these tools (JSON schema of each function):\n<tools>\n{tools}\n</tools>\n"
                  "To call a tool, write only <tool_call>{{\"name\": <function name>, \"arguments\": <arguments "
                  "object>}}</tool_call>, one block per call.")


@dataclass
class ToolPlan:
    """The validated tools of a request and what tool_choice asks for."""

    functions: list[dict]  # [{"name", "description"?, "parameters"?}]
    choice: str  # "none" | "auto" | "required" | "named"
    named: Optional[str] = None  # the function tool_choice names
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def call_schema(self) -> dict:
        """JSON schema of the one call a constrained request writes."""
        options = [_call_schema(f) for f in self.functions if self.choice == "required" or f["name"] == self.named]
        return options[0] if len(options) == 1 else {"anyOf": options}

    @staticmethod
    def call_prefix(name: str) -> str:
        """The text a constrained call starts with, up to its arguments (compact JSON, properties in schema order)."""
        return '{"name":' + json.dumps(name, ensure_ascii=False) + ',"arguments":'


def _call_schema(function: dict) -> dict:
    params = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}  # strict: see plan_tools


def plan_tools(tools: Optional[list], tool_choice: Any, parallel_tool_calls: Optional[bool]) -> Optional[ToolPlan]:
    """Check tools and tool_choice (400s name the parameter); None when the request has no tools."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}",
                              param=f"tools.{i}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(f"tools[{i}].function.name must match [A-Za-z0-9_-]{{1,64}}",
                              param=f"tools.{i}.function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object",
                              param=f"tools.{i}.function.parameters")
        unknown = sorted(set(tool) - {"type", "function"}) + sorted(f"function.{k}" for k in set(fn) - _FUNCTION_KEYS)
        if unknown:
            raise bad_request(f"tools[{i}] has keys braid does not take: {', '.join(unknown)}", param=f"tools.{i}")
        if fn.get("strict") and tool_choice in (None, "auto"):
            raise bad_request(f"tools[{i}].function.strict: calls are held to their schemas only under tool_choice "
                              '"required" or a named function (under "auto" they are parsed from free text)',
                              param=f"tools.{i}.function.strict")
        functions.append({k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None})
    if len({f["name"] for f in functions}) != len(functions):
        raise bad_request("tools: function names must be distinct", param="tools")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    choice = "auto" if tool_choice is None else tool_choice
    if choice in ("none", "auto", "required"):
        return ToolPlan(functions, choice, parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in {f["name"] for f in functions}:
            raise bad_request(f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")
        return ToolPlan(functions, "named", named=name, parallel=parallel)
    raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                      '{"name": ...}}', param="tool_choice")


def template_knows_tools(chat_template: Optional[str]) -> bool:
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


# `{% if ...['role'] == 'system' %}{{ raise_exception(...) }}`: Gemma-2's templates (and --chat-template gemma-it)
_RAISES_ON_SYSTEM = re.compile(r"""['"]system['"]\s*-?%\}\s*\{\{-?\s*raise_exception""")


def template_refuses_system(chat_template: Optional[str]) -> bool:
    return bool(chat_template) and _RAISES_ON_SYSTEM.search(chat_template) is not None


def history_for_template(messages: list[dict], raw_messages: list, plan: Optional[ToolPlan],
                         native_tools: bool, system_role: bool = True) -> list[dict]:
    """Messages with earlier tool calls and tool results: as the template wants them (native_tools), or in braid's
    <tool_call> format with tool results as user turns; plus braid's tool instructions when the template cannot
    render the tools itself: a system message, or the head of the first user turn for a template without a system
    role (a turn of its own would break the user/model alternation such templates check)."""
    out = []
    for m, raw in zip(messages, raw_messages):
        calls = raw.tool_calls or []
        if native_tools:
            m = dict(m)
            if calls:
                m["tool_calls"] = [_template_call(c) for c in calls]
            if raw.tool_call_id is not None:
                m["tool_call_id"] = raw.tool_call_id
        elif m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{content_text(m['content'])}\n</tool_response>"}
        elif calls:
            blocks = "".join(CALL_OPEN + json.dumps(_template_call(c)["function"], ensure_ascii=False) + CALL_CLOSE
                             for c in calls)
            m = {**m, "content": add_text(m["content"] or "", blocks)}
        out.append(m)
    if plan is not None and plan.choice != "none" and not native_tools:
        text = _SYSTEM_PROMPT.format(tools="\n".join(json.dumps(f, ensure_ascii=False) for f in plan.functions))
        first_user = next((i for i, m in enumerate(out) if m["role"] == "user"), None)
        if not system_role and first_user is not None:
            out[first_user] = {**out[first_user], "content": add_text(out[first_user]["content"], text + "\n\n",
                                                                      before=True)}
        elif out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": add_text(out[0]["content"], "\n\n" + text)}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _template_call(call: Any) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request("messages[].tool_calls[] must be {\"type\": \"function\", \"function\": {\"name\", "
                          "\"arguments\"}}", param="messages")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return {"type": "function", "id": call.get("id"), "function": {"name": fn["name"], "arguments": args}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_call(name: str, arguments: str, index: int) -> dict:
    return {"index": index, "id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_constrained(text: str) -> Optional[dict]:
    """The call a constrained request wrote (None if it was cut short); its arguments as the model wrote them, the
    same text the streamed deltas carry."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
        return None
    prefix = ToolPlan.call_prefix(obj["name"])
    if text.startswith(prefix) and text.endswith("}"):
        arguments = text[len(prefix):-1]
    else:
        arguments = json.dumps(obj["arguments"], ensure_ascii=False)
    return tool_call(obj["name"], arguments, 0)


def parse_auto(text: str, plan: ToolPlan) -> tuple[Optional[str], list[dict]]:
    """(content, tool calls) of free text: each well-formed <tool_call> block naming a known function is a call;
    the rest of the text is the content. Blocks that do not parse stay in the content."""
    known = {f["name"] for f in plan.functions}
    calls, content, last = [], [], 0
    for m in _CALL_BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or obj.get("name") not in known:
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        content.append(text[last:m.start()])
        last = m.end()
        if plan.parallel or not calls:
            calls.append(tool_call(obj["name"], json.dumps(args, ensure_ascii=False), len(calls)))
    content.append(text[last:])
    joined = "".join(content).strip()
    return (joined or None) if calls else text, calls


class ToolStream:
    """Streaming for one choice: splits the text deltas into content deltas and tool_calls deltas.

    Constrained: the call's name goes out as soon as the prefix naming it is complete, then its arguments as they
    come (the call's closing brace held back). Auto: content streams until a `<tool_call>` may be starting; a
    block goes out as one tool_calls delta when it closes, or back into the content if it is no call."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of `text` handled
        self.num_calls = 0
        self.args_started = False

    def feed(self, delta: str, finished: bool) -> list[dict]:
        """Delta dicts ({"content": ...} or {"tool_calls": [...]}) for this piece of text."""
        self.text += delta
        return self._constrained(finished) if self.plan.constrained else self._auto(finished)

    def _constrained(self, finished: bool) -> list[dict]:
        out = []
        if not self.args_started:
            for f in self.plan.functions:
                prefix = self.plan.call_prefix(f["name"])
                if self.text.startswith(prefix):
                    call = tool_call(f["name"], "", 0)
                    out.append({"tool_calls": [call]})
                    self.args_started, self.sent, self.num_calls = True, len(prefix), 1
                    break
        if self.args_started:
            # the last character may be the call's closing brace: held back until the end, then dropped
            end = len(self.text) - (1 if not finished or self.text.endswith("}") else 0)
            if end > self.sent:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": self.text[self.sent:end]}}]})
                self.sent = end
        return out

    def _auto(self, finished: bool) -> list[dict]:
        out = []
        while True:
            rest = self.text[self.sent:]
            start = rest.find(CALL_OPEN)
            if start == -1:
                hold = 0 if finished else _partial_suffix(rest, CALL_OPEN)
                if len(rest) - hold > 0:
                    out.append({"content": rest[:len(rest) - hold]})
                    self.sent += len(rest) - hold
                return out
            if start > 0:
                out.append({"content": rest[:start]})
                self.sent += start
                continue
            close = rest.find(CALL_CLOSE)
            if close == -1:
                if finished:
                    out.append({"content": rest})
                    self.sent = len(self.text)
                return out
            block = rest[:close + len(CALL_CLOSE)]
            _, calls = parse_auto(block, self.plan)
            if calls and (self.plan.parallel or self.num_calls == 0):
                call = {**calls[0], "index": self.num_calls}
                self.num_calls += 1
                out.append({"tool_calls": [call]})
            elif not calls:
                out.append({"content": block})
            self.sent += len(block)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
