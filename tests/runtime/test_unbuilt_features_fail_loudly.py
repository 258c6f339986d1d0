"""What braid does not build yet fails at start with a clear error instead of running wrong."""

import json

import pytest

from braid.runtime.config import ServerArgs
from braid.runtime.engine import Engine

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 49152,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "eos_token_id": 2}


def _engine(**overrides):
    return Engine(model_path="smollm2", load_format="dummy", model_config=json.dumps({**TINY, **overrides}),
                  max_total_tokens=1024, log_level="warning")


def test_a_quantized_checkpoint_is_refused():
    with pytest.raises(ValueError, match="quantization 'awq' is not supported"):
        _engine(quantization_config={"quant_method": "awq"})


def test_a_plain_tiny_model_runs():
    with _engine() as engine:
        out = engine.generate("hello", {"max_new_tokens": 3, "temperature": 0})
        assert len(out["output_ids"]) == 3
        assert engine.get_stats()["kv_used_tokens"] == 0


@pytest.mark.parametrize("fields, message", [
    (dict(tp_size=0), "must be >= 1"),
    (dict(tp_size=2, quantization="fp8"), "with tp_size > 1 is not supported yet"),
    (dict(tp_size=2, nnodes=2), "needs --dist-init-addr"),
    (dict(tp_size=2, node_rank=1), r"node_rank in \[0, nnodes\)"),
])
def test_parallelism_that_cannot_run_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**fields)


def test_a_gpu_only_attention_backend_is_refused_on_cpu():
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        Engine(model_path="smollm2", device="cpu", attention_backend="triton", max_total_tokens=1024,
               log_level="warning")
