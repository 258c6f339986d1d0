"""A GGUF's first use parses its metadata once: transformers' tokenizer conversion reads the gguf reader braid parsed
for the config (each parse of Gemma-3-270M's 262k-token vocabulary costs 11 s and holds ~0.7 GB), gives the tokenizer
transformers gives on its own, and the reader is dropped once a scheduler has loaded its model and tokenizer."""

import os

import pytest

from braid.runtime.loader import gguf as braid_gguf
from braid.runtime.loader.model_path import resolve_model_path
from braid.runtime.loader.tokenizer import load_tokenizer

TEXTS = ["The capital of France is", "def fibonacci(n):\n    return n", "<|im_start|>user\nHi!<|im_end|>\n",
         "naïve café, 東京, 🙂 and 12345.678"]


@pytest.fixture
def parses(monkeypatch, tmp_path):
    """The paths gguf readers were built for (a fresh braid cache: every conversion is a first use)."""
    import gguf
    import gguf.gguf_reader

    monkeypatch.setenv("BRAID_CACHE_DIR", str(tmp_path))
    built = []

    class CountingReader(gguf.gguf_reader.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            built.append(os.fspath(path))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf.gguf_reader, "GGUFReader", CountingReader)
    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    braid_gguf.release_gguf_readers()
    yield built
    braid_gguf.release_gguf_readers()


def test_tokenizer_conversion_reads_the_config_parse_and_equals_transformers_own(parses):
    import gguf
    import transformers

    path = resolve_model_path("smollm2")
    braid_gguf.gguf_config(path)
    ours = load_tokenizer.__wrapped__(path)
    assert parses == [path]  # the config's parse served the tokenizer's conversion too
    assert gguf.GGUFReader.__name__ == "CountingReader"  # transformers' name is back to what it was
    assert braid_gguf._reader.cache_info().currsize == 1
    braid_gguf.release_gguf_readers()
    assert braid_gguf._reader.cache_info().currsize == 0
    theirs = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    assert len(parses) == 2  # transformers on its own parses again
    assert ours.get_vocab() == theirs.get_vocab()
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text


def test_other_files_and_arguments_get_readers_of_their_own(parses, tmp_path):
    import gguf

    shared, other = str(tmp_path / "shared.gguf"), str(tmp_path / "other.gguf")
    for path in (shared, other):
        writer = gguf.GGUFWriter(path, "llama")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    with braid_gguf.transformers_reads_through_braids_reader(shared):
        assert gguf.GGUFReader(shared) is gguf.GGUFReader(shared) is braid_gguf._reader(shared)
        assert gguf.GGUFReader(shared, "r") is not braid_gguf._reader(shared)
        assert gguf.GGUFReader(other) is not gguf.GGUFReader(other)
    assert parses == [shared, shared, other, other]
