"""A tiny random Llama or Qwen2 (save_pretrained, byte tokenizer) and random PEFT LoRA adapters written by peft itself, for the
LoRA tests: adapters of different ranks and target modules, one with rslora scaling."""

import torch

from byte_tokenizer import byte_tokenizer

VOCAB = 320
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
# name -> peft LoraConfig fields: "sql" the attention projections (q/k/v land in braid's fused qkv_proj),
# "router" v and the whole MLP (gate/up land in gate_up_proj) at a larger rank with rslora
ADAPTERS = {
    "sql": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "router": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["v_proj", "gate_proj", "up_proj", "down_proj"]),
}


FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def write_base(folder, family: str = "llama"):
    """A random model of `family` (qwen2: q/k/v biases, which the adapters' deltas join)."""
    import transformers

    cfg_cls, model_cls = FAMILIES[family]
    cfg = getattr(transformers, cfg_cls)(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # larger than HF's init so the logits are far from uniform
        for name, p in model.named_parameters():
            if p.dim() > 1 or name.endswith(".bias"):
                p.normal_(0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    tok = byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return model


def write_adapter(base_folder, folder, seed: int, **lora_fields) -> None:
    """A peft adapter on a fresh copy of the base, its A and B random (peft starts B at zero, a no-op adapter)."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_folder)
    model = peft.get_peft_model(base, peft.LoraConfig(lora_dropout=0.0, **lora_fields))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.25)
    model.save_pretrained(folder, safe_serialization=True)


def write_all(root, family: str = "llama") -> dict[str, str]:
    """root/base and root/<adapter> for every ADAPTERS entry -> {"base": path, name: path, ...}."""
    paths = {"base": str(root / "base")}
    write_base(paths["base"], family)
    for seed, (name, fields) in enumerate(ADAPTERS.items(), start=1):
        paths[name] = str(root / name)
        write_adapter(paths["base"], paths[name], seed, **fields)
    return paths
