"""Chat templates: how role blocks (system/user/assistant) are rendered into prompt text.

A backend picks the template (`Backend.get_chat_template()`); the runtime may report its tokenizer's
template by name or as Jinja text, from which `chat_template_for` guesses; the default is ChatML.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from braid.errors import ProgramError

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    role_markers: dict[str, tuple[str, str]]  # role -> (prefix, suffix)
    default_system_prompt: Optional[str] = None  # rendered first when a program starts with a non-system role
    stop_str: tuple[str, ...] = ()
    image_token: str = "<image>"
    video_token: str = "<video>"
    aliases: tuple[str, ...] = field(default=())

    def role_prefix(self, role: str) -> str:
        return self._markers(role)[0]

    def role_suffix(self, role: str) -> str:
        return self._markers(role)[1]

    def _markers(self, role: str) -> tuple[str, str]:
        try:
            return self.role_markers[role]
        except KeyError:
            raise ProgramError(f"chat template {self.name!r} has no role {role!r} (roles: {', '.join(self.role_markers)})") from None

    def render_messages(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The text of `messages` ([{"role", "content": str}]) as a program would produce it."""
        parts = []
        if self.default_system_prompt is not None and (not messages or messages[0]["role"] != "system"):
            parts.append(self.role_prefix("system") + self.default_system_prompt + self.role_suffix("system"))
        for m in messages:
            parts.append(self.role_prefix(m["role"]) + m["content"] + self.role_suffix(m["role"]))
        if add_generation_prompt:
            parts.append(self.role_prefix("assistant"))
        return "".join(parts)


_REGISTRY: dict[str, ChatTemplate] = {}


def register_chat_template(template: ChatTemplate) -> ChatTemplate:
    for key in (template.name, *template.aliases):
        _REGISTRY[key.lower()] = template
    return template


def get_chat_template(name: str) -> ChatTemplate:
    try:
        return _REGISTRY[name.lower()]
    except KeyError:
        raise ProgramError(f"unknown chat template {name!r}; known: {', '.join(sorted({t.name for t in _REGISTRY.values()}))}") from None


def list_chat_templates() -> list[str]:
    return sorted({t.name for t in _REGISTRY.values()})


CHATML = register_chat_template(ChatTemplate(
    name="chatml",
    role_markers={r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ROLES},
    stop_str=("<|im_end|>",),
    aliases=("smollm2", "qwen2", "chatml-default"),
))

LLAMA3 = register_chat_template(ChatTemplate(
    name="llama-3",
    role_markers={r: (f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>") for r in ROLES},
    stop_str=("<|eot_id|>",),
    aliases=("llama-3-instruct", "llama3", "llama-3.1"),
))

GEMMA = register_chat_template(ChatTemplate(
    name="gemma-it",
    role_markers={
        "system": ("<start_of_turn>user\n", "<end_of_turn>\n"),
        "user": ("<start_of_turn>user\n", "<end_of_turn>\n"),
        "assistant": ("<start_of_turn>model\n", "<end_of_turn>\n"),
    },
    stop_str=("<end_of_turn>",),
    aliases=("gemma", "gemma-2"),
))

PLAIN = register_chat_template(ChatTemplate(
    name="plain",
    role_markers={"system": ("", "\n\n"), "user": ("User: ", "\n"), "assistant": ("Assistant: ", "\n")},
    aliases=("default", "completion"),
))

# substrings of a Jinja chat template (or a model path) -> template
_JINJA_MARKERS = (("<|im_start|>", CHATML), ("<|start_header_id|>", LLAMA3), ("<start_of_turn>", GEMMA))
_PATH_MARKERS = (("llama-3", LLAMA3), ("llama3", LLAMA3), ("gemma", GEMMA), ("smollm", CHATML), ("qwen", CHATML))


def chat_template_for(reported: Optional[str] = None, model_path: Optional[str] = None) -> ChatTemplate:
    """The template for a backend: from the tokenizer's reported template (a registered name or Jinja
    text), else from the model path, else ChatML."""
    if reported:
        if reported.lower() in _REGISTRY:
            return _REGISTRY[reported.lower()]
        for marker, template in _JINJA_MARKERS:
            if marker in reported:
                return template
    if model_path:
        lowered = model_path.lower()
        for marker, template in _PATH_MARKERS:
            if marker in lowered:
                return template
    return CHATML
