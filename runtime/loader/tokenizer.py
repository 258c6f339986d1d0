"""Tokenizers from an HF folder or from a GGUF file (through transformers)."""

from __future__ import annotations

import functools
import os

from braid.runtime.loader.cache import cached_dir
from braid.runtime.loader.model_path import is_gguf, resolve_model_path


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str):
    import transformers

    path = resolve_model_path(path)
    if not is_gguf(path):
        return transformers.AutoTokenizer.from_pretrained(path)

    def convert(out_dir: str) -> None:
        from braid.runtime.loader.gguf import transformers_reads_through_braids_reader

        # braid's reader of the file (parsed for the config or the weights, else now), not a parse of its own
        with transformers_reads_through_braids_reader(path):
            tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        tok.save_pretrained(out_dir)

    return transformers.AutoTokenizer.from_pretrained(cached_dir(path, "tokenizer", convert))


def get_tokenizer(server_args):
    return load_tokenizer(server_args.tokenizer_path or server_args.model_path)
