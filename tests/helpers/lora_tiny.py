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


# a third adapter for the paging tests (q and the MLP's down projection, rank 2); written apart from ADAPTERS so that
# servers started with every ADAPTERS entry keep serving exactly those
THIRD = ("tagger", dict(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"]))


def write_third(root, paths: dict[str, str]) -> dict[str, str]:
    """root/tagger next to write_all's folders; -> paths with it added."""
    name, fields = THIRD
    out = dict(paths)
    out[name] = str(root / name)
    write_adapter(paths["base"], out[name], 11, **fields)
    return out


def write_misfit(src: str, dst: str) -> None:
    """A copy of the adapter folder src whose first lora_A has half the base linear's input width (wrong shapes)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    file = f"{dst}/adapter_model.safetensors"
    tensors = load_file(file)
    key = sorted(k for k in tensors if "lora_A" in k)[0]
    tensors[key] = tensors[key][:, : tensors[key].shape[1] // 2].contiguous()
    save_file(tensors, file)


def peft_model(base: str, adapters: dict[str, str]):
    """The HF base model at `base` with every adapter of `adapters` (name -> folder) loaded through peft."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    order = list(adapters)
    model = peft.PeftModel.from_pretrained(model, adapters[order[0]], adapter_name=order[0])
    for name in order[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model


def peft_greedy(base: str, adapters: dict[str, str], prompts: list[list[int]], names: list, max_new_tokens: int):
    """HF + peft's greedy tokens for each prompt under its adapter (a name of `adapters`, or None: the base)."""
    model = peft_model(base, adapters)
    out = []
    for ids, name in zip(prompts, names):
        x = torch.tensor([ids])
        kw = dict(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                  eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            if name is None:
                with model.disable_adapter():
                    gen = model.generate(**kw)
            else:
                model.set_adapter(name)
                gen = model.generate(**kw)
        out.append(gen[0, len(ids):].tolist())
    return out
