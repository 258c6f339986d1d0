"""Message content in the shape a chat template takes it.

A template takes a message's content in one of two formats (vLLM's names):
- "openai": the list of content parts, which the template iterates ({% for part in message['content'] %}); text parts
  are {"type": "text", "text": ...}, media parts {"type": "image"} / {"type": "video"} as HF processors pass them, and
  the template writes each medium's placeholder (`<image>`, `<video>`) where the model was trained to see it.
- "string": one text per message; media parts become a bare `<image>` / `<video>` where they were, text parts are
  joined as they are.
`detect_content_format` reads the template's Jinja syntax tree for a loop over a message's content; `load_chat_template`
reads --chat-template (a name, a file, or the template's text). The server and the in-process Engine both render
through these.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any, Optional, Union

from braid.runtime.multimodal.prompt import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER

# --chat-template NAME: SGLang's names for the formats most checkpoints use
_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_LLAMA_3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
            "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
_GEMMA_IT = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
             "{{ raise_exception('Gemma has no system role') }}{% endif %}"
             "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] | trim }}"
             "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
NAMED_CHAT_TEMPLATES = {"chatml": _CHATML, "qwen": _CHATML, "llama-3-instruct": _LLAMA_3, "gemma-it": _GEMMA_IT}


def load_chat_template(value: str) -> str:
    """--chat-template: a name in NAMED_CHAT_TEMPLATES, a file holding a Jinja template, or the template's text."""
    if value in NAMED_CHAT_TEMPLATES:
        return NAMED_CHAT_TEMPLATES[value]
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a known name ({', '.join(sorted(NAMED_CHAT_TEMPLATES))}), "
                     "a file, nor a Jinja template (no {{ or {% in it)")


def with_chat_template(tokenizer, chat_template: Optional[str]):
    """The tokenizer with --chat-template in place of its own; a copy, since tokenizers are cached and shared."""
    if chat_template is None:
        return tokenizer
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = load_chat_template(chat_template)
    return tokenizer


CONTENT_FORMATS = ("string", "openai")

# a template part's placeholder in string format (runtime/multimodal/prompt.py fills them in order)
_PLACEHOLDERS = {"image": IMAGE_PLACEHOLDER, "video": VIDEO_PLACEHOLDER}

Content = Union[str, list]  # a message's content: text, or template parts [{"type": "text" | "image" | "video", ...}]


def in_content_format(messages: list[dict], content_format: str) -> list[dict]:
    """Messages whose content is text or template parts -> every content as `content_format` wants it."""
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"content format {content_format!r} is not one of {', '.join(CONTENT_FORMATS)}")
    out = []
    for m in messages:
        content = m.get("content")
        if content_format == "openai" and isinstance(content, str):
            content = [{"type": "text", "text": content}] if content else []
        elif content_format == "string" and isinstance(content, list):
            content = content_text(content, placeholders=True)
        out.append({**m, "content": content})
    return out


def content_text(content: Optional[Content], placeholders: bool = False) -> str:
    """A content's text: its text parts joined as they are (with `placeholders`, media parts as <image> / <video>)."""
    if not isinstance(content, list):
        return content or ""
    return "".join(p["text"] if p["type"] == "text" else _PLACEHOLDERS[p["type"]] if placeholders else ""
                   for p in content)


# ---- detecting the format from the template -------------------------------------------------------------------
def resolve_content_format(option: str, chat_template: Any) -> str:
    """--chat-template-content-format: "string" / "openai" as given; "auto" detected from the template (a tokenizer's
    chat_template as it is: one that is not a Jinja string, none or a dict of named templates, is "string")."""
    if option != "auto":
        return option
    return detect_content_format(chat_template) if isinstance(chat_template, str) and chat_template else "string"


def render_chat_template(tokenizer, messages: list[dict], content_format: str, add_generation_prompt: bool = True,
                         **template_kwargs: Any) -> str:
    """The tokenizer's chat template over `messages` (content: text, or template parts) in `content_format`, as text;
    template_kwargs are further template variables (tools, continue_final_message, ...)."""
    return tokenizer.apply_chat_template(in_content_format(messages, content_format), tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **template_kwargs)


@functools.lru_cache(maxsize=16)
def detect_content_format(chat_template: str) -> str:
    """"openai" when the template loops over a message's content (`for x in message['content']`, also through
    filters, tests, slices or a variable set from it, with messages reached through variables set from `messages`),
    else "string". A template Jinja cannot parse is "string"; rendering it reports the syntax error."""
    try:
        tree = _jinja_environment().parse(chat_template)
    except Exception:  # noqa: BLE001 - jinja2.TemplateSyntaxError and friends
        return "string"
    import jinja2.nodes as n

    loops = list(tree.find_all(n.For))
    assigns = list(tree.find_all(n.Assign))
    message_lists = _grow({"messages"}, assigns, lambda node, names: _reads(node, names))
    messages = {loop.target.name for loop in loops
                if isinstance(loop.target, n.Name) and _reads(loop.iter, message_lists)}
    # a message picked by index (`set last = messages[-1]`) is a message too
    messages |= {a.target.name for a in assigns if isinstance(a.target, n.Name) and isinstance(a.node, n.Getitem)
                 and not isinstance(a.node.arg, n.Slice) and _reads(a.node.node, message_lists)}
    contents = _grow(set(), assigns, lambda node, names: _reads(node, messages, "content") or _reads(node, names))
    return "openai" if any(_reads(loop.iter, messages, "content") or _reads(loop.iter, contents)
                           for loop in loops) else "string"


def _jinja_environment():
    """The environment HF renders chat templates in (its extensions, e.g. {% generation %}, parse)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template("").environment


def _grow(names: set, assigns: list, reads) -> set:
    """`names` plus every variable set (transitively) from an expression `reads(expr, names)` accepts."""
    import jinja2.nodes as n

    names = set(names)
    changed = True
    while changed:
        changed = False
        for a in assigns:
            if isinstance(a.target, n.Name) and a.target.name not in names and reads(a.node, names):
                names.add(a.target.name)
                changed = True
    return names


def _reads(node: Any, names: set, key: Optional[str] = None) -> bool:
    """Whether `node` is one of `names` (with `key`: its `key` item, x['key'] or x.key), seen through filters
    (x | selectattr(...)), tests and slices (x[1:])."""
    import jinja2.nodes as n

    while True:
        if isinstance(node, (n.Filter, n.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
            node = node.node
        else:
            break
    if key is None:
        return isinstance(node, n.Name) and node.ctx == "load" and node.name in names
    if isinstance(node, n.Getitem) and isinstance(node.arg, n.Const) and node.arg.value == key:
        return _reads(node.node, names)
    if isinstance(node, n.Getattr) and node.attr == key:
        return _reads(node.node, names)
    return False
