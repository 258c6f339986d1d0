"""Constrained decoding: regex, JSON schema, Lark / GBNF grammars and structural tags -> packed token bitmasks, on
llguidance or outlines-core, with jump-forward.

Names load lazily: the compile worker process imports `compile_pool` (and its errors and regex index) and must not pull in torch.
"""

_EXPORTS = {
    "GrammarError": "grammar_errors",
    "GrammarTimeoutError": "grammar_errors",
    "GrammarBusyError": "grammar_errors",
    "GrammarBackend": "grammar",
    "fill_bitmasks": "grammar",
    "accept_tokens": "grammar",
    "allocate_bitmask": "bitmask",
    "unpack_row": "bitmask",
    "JumpForward": "jump_forward",
    "json_schema_to_regex": "json_schema",
    "choices_to_regex": "json_schema",
    "TokenVocabulary": "vocabulary",
    "build_token_vocabulary": "vocabulary",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = list(_EXPORTS)
