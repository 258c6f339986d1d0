"""braid: a structured-generation language embedded in Python.

`import braid` stays light (no torch): backends load on first use of their names.
"""

from braid.api import (assistant, assistant_begin, assistant_end, flush_cache, function, gen, gen_int, gen_string,
                       image, select, system, system_begin, system_end, user, user_begin, user_end, video)
from braid.chat_template import ChatTemplate, chat_template_for, get_chat_template, register_chat_template
from braid.choices import (ChoicesDecision, ChoicesMethod, greedy_token_selection, token_length_normalized,
                           unconditional_likelihood_normalized)
from braid.defaults import get_default_backend, set_default_backend
from braid.errors import (BackendError, BackendRequestError, BraidError, NoBackendError, ProgramError,
                          ServerStartError, UnsupportedFeatureError)
from braid.program import BraidFunction
from braid.state import ForkGroup, ProgramState
from braid.tracer import Trace

__version__ = "0.1.0"

_LAZY = {
    "Backend": ("braid.backends.base", "Backend"),
    "RuntimeEndpoint": ("braid.backends.runtime_endpoint", "RuntimeEndpoint"),
    "Runtime": ("braid.backends.runtime", "Runtime"),
    "LocalEngine": ("braid.backends.local", "LocalEngine"),
    "OpenAI": ("braid.backends.openai", "OpenAI"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'braid' has no attribute {name!r}")


__all__ = [
    "function", "gen", "gen_int", "gen_string", "select", "image", "video",
    "system", "user", "assistant", "system_begin", "system_end", "user_begin", "user_end",
    "assistant_begin", "assistant_end", "set_default_backend", "get_default_backend", "flush_cache",
    "token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized",
    "ChoicesMethod", "ChoicesDecision", "ChatTemplate", "get_chat_template", "register_chat_template",
    "chat_template_for", "ProgramState", "ForkGroup", "BraidFunction", "Trace",
    "BraidError", "ProgramError", "NoBackendError", "UnsupportedFeatureError", "BackendError",
    "BackendRequestError", "ServerStartError", *_LAZY,
]
