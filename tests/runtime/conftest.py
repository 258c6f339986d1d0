import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The runtime's own SmolLM2 tokenizer (converted from the embedded GGUF once, then cached on disk)."""
    from braid.runtime.loader.tokenizer import load_tokenizer

    return load_tokenizer("smollm2")
