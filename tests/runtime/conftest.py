import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The runtime's own SmolLM2 tokenizer (converted from the embedded GGUF once, then cached on disk)."""
    from braid.runtime.loader.tokenizer import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture(scope="session")
def eagle_ckpt(tmp_path_factory):
    """The EAGLE engine tests' checkpoints (tests/helpers/eagle_engine_cases.py), written once."""
    from eagle_engine_cases import write_checkpoints

    return write_checkpoints(tmp_path_factory.mktemp("eagle"))


@pytest.fixture(scope="session")
def eagle_plain(eagle_ckpt):
    """(stop string, outputs) of the EAGLE engine tests' cases without speculation."""
    from eagle_engine_cases import plain_outputs

    return plain_outputs(eagle_ckpt)
