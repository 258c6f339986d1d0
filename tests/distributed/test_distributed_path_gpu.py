"""On CUDA: one rank through the distributed code path (NCCL world of one: every all-reduce, the vocab-parallel
embedding's masked path, the LM head's all-gather, the sampled-id broadcast, the leader's gloo broadcasts) decodes
exactly what the plain path does, eagerly and with CUDA graphs. Skipped without CUDA."""

import os

import pytest
import torch

from braid.runtime import Engine
from braid.runtime.processes.tensor_parallel import free_loopback_addr

pytestmark = pytest.mark.gpu

GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
# the GPU machine has no SmolLM2 package: its tokenizer travels as .gpu/tok (benchmarks/gpu/setup.sh)
TOKENIZER = ".gpu/tok" if os.path.isdir(".gpu/tok") else "smollm2"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import transformers

    path = tmp_path_factory.mktemp("tiny_llama")
    cfg = transformers.LlamaConfig(vocab_size=1001, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.mark.parametrize("disable_cuda_graph", [True, False])
def test_nccl_world_of_one_decodes_what_the_plain_path_does(tiny_llama, disable_cuda_graph):
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1001, (n,), generator=gen).tolist() for n in (5, 33, 17)]
    outputs = []
    for extra in ({}, {"dist_init_addr": free_loopback_addr()}):
        with Engine(model_path=tiny_llama, tokenizer_path=TOKENIZER, dtype="float32", max_total_tokens=4096,
                    disable_cuda_graph=disable_cuda_graph, log_level="warning", **extra) as engine:
            outputs.append([r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=GREEDY)])
    assert outputs[1] == outputs[0]
