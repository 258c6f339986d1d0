import pytest
import torch
from suite_memory import close_when_leaving_folder

from braid.runtime.loader.model_path import resolve_model_path

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.\n",
    "def fibonacci(n):\n    ",
    "Q: What is 17 + 25?\nA:",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter who " * 3,
    "1, 2, 3, 4,",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
    "The following is a list of the largest cities in Europe by population: " + "London, Paris, Berlin, Madrid, Rome, " * 6,
]
NEW_TOKENS = 48


@pytest.fixture(scope="session")
def parity_prompts():
    return PROMPTS


@pytest.fixture(scope="session")
def new_tokens():
    return NEW_TOKENS


@pytest.fixture(scope="session")
def hf_smollm2(request):
    from hf_gguf import hf_model_from_gguf

    model = hf_model_from_gguf(resolve_model_path("smollm2"))
    close_when_leaving_folder(request, __file__, lambda: model.to_empty(device="meta"))  # frees the weights
    return model


@pytest.fixture(scope="session")
def smollm2_tok():
    from braid.runtime.loader.tokenizer import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture(scope="session")
def hf_greedy(hf_smollm2, smollm2_tok):
    """HF transformers' greedy continuation of every prompt, one at a time (no padding effects)."""
    outs = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([smollm2_tok.encode(p)])
            gen = hf_smollm2.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, ids.shape[1]:].tolist())
    return outs
