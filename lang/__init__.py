"""braid: a structured-generation language embedded in Python.

`import braid` stays light (no torch): backends load on first use of their names.

SGLang v0.3's top-level names work here too (docs/language.md lists them): `Engine` is braid.runtime's
offline engine, `global_config` holds the language settings, `get_server_info` / `get_server_args` query a
runtime backend, and other providers (SGLang's Anthropic, VertexAI) go through `LiteLLM`.
"""

from braid.api import (assistant, assistant_begin, assistant_end, flush_cache, function, gen, gen_int, gen_string,
                       get_server_args, get_server_info, image, select, system, system_begin, system_end, user,
                       user_begin, user_end, video)
from braid.chat_template import ChatTemplate, chat_template_for, get_chat_template, register_chat_template
from braid.choices import (ChoicesDecision, ChoicesMethod, greedy_token_selection, token_length_normalized,
                           unconditional_likelihood_normalized)
from braid.defaults import get_default_backend, set_default_backend
from braid.errors import (BackendError, BackendRequestError, BraidError, NoBackendError, ProgramError,
                          ServerStartError, UnsupportedFeatureError)
from braid.program import BraidFunction
from braid.run_trace import RunTrace, collected_trace, merge_traces
from braid.state import ForkGroup, ProgramState
from braid.global_config import global_config
from braid.tracer import Trace

__version__ = "0.1.0"

_LAZY = {
    "Backend": ("braid.backends.base", "Backend"),
    "RuntimeEndpoint": ("braid.backends.runtime_endpoint", "RuntimeEndpoint"),
    "Runtime": ("braid.backends.runtime", "Runtime"),
    "LocalEngine": ("braid.backends.local", "LocalEngine"),
    "OpenAI": ("braid.backends.openai", "OpenAI"),
    "LiteLLM": ("braid.backends.litellm", "LiteLLM"),
    "Engine": ("braid.runtime.engine", "Engine"),
}

# SGLang backends braid reaches through LiteLLM's provider routes instead
_THROUGH_LITELLM = {"Anthropic": "anthropic/", "VertexAI": "vertex_ai/"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    if name in _THROUGH_LITELLM:
        raise AttributeError(f"braid has no {name} backend; use braid.LiteLLM(\"{_THROUGH_LITELLM[name]}<model>\") "
                             "(pip install 'braid[litellm]')")
    raise AttributeError(f"module 'braid' has no attribute {name!r}")


__all__ = [
    "function", "gen", "gen_int", "gen_string", "select", "image", "video",
    "system", "user", "assistant", "system_begin", "system_end", "user_begin", "user_end",
    "assistant_begin", "assistant_end", "set_default_backend", "get_default_backend", "flush_cache",
    "get_server_info", "get_server_args", "global_config",
    "token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized",
    "ChoicesMethod", "ChoicesDecision", "ChatTemplate", "get_chat_template", "register_chat_template",
    "chat_template_for", "ProgramState", "ForkGroup", "BraidFunction", "Trace",
    "RunTrace", "collected_trace", "merge_traces",
    "BraidError", "ProgramError", "NoBackendError", "UnsupportedFeatureError", "BackendError",
    "BackendRequestError", "ServerStartError", *_LAZY,
]
