"""HF transformers' own GGUF loading (the parity reference) with the file parsed once: transformers builds a new
gguf.GGUFReader for the config, the weights and the tokenizer, and each parses every metadata field (11 s apiece for
Gemma-3-270M's 262k-token vocabulary). Inside `transformers_reads_through_braids_reader` they share one gguf reader;
what transformers makes of it is unchanged."""

import os

import torch

from braid.runtime.loader.gguf import transformers_reads_through_braids_reader


def hf_model_from_gguf(path: str, with_tokenizer: bool = False):
    """transformers' model (fp32, eval) from the GGUF at `path`, and with_tokenizer: (its tokenizer, the model). The
    parsed reader stays for braid's own first-use conversions of the file; the next Engine or server drops it."""
    import transformers

    folder, name = os.path.split(path)
    with transformers_reads_through_braids_reader(path):
        tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name) if with_tokenizer else None
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return (tok, model.eval()) if with_tokenizer else model.eval()
