"""EAGLE / EAGLE-3 draft heads written in their published checkpoint layouts (config.json + model.safetensors:
`fc`, Llama layers named `layers.N.*` or EAGLE-3's `midlayer.*`, `norm`, `lm_head`, `d2t` / `t2d`), and tiny Llama
targets for them (save_pretrained, byte tokenizer): a random one, and one whose next token is easy to predict (a
fixed successor of the current token) with a head built to predict it."""

import json

import torch
from safetensors.torch import save_file

from byte_tokenizer import byte_tokenizer

H, V, DRAFT_V = 32, 96, 40  # the head unit tests' shapes


def rand(*shape, gen):
    return torch.randn(*shape, generator=gen) * 0.2


def llama_layer_tensors(prefix: str, gen, attn_in: int, input_norm: bool, hidden: int = H, heads: int = 4,
                        kv_heads: int = 2, inter: int = 64) -> dict:
    """One Llama decoder layer's tensors under `prefix`, in EAGLE's published names (random, std 0.2)."""
    hd = hidden // heads
    t = {f"{prefix}self_attn.q_proj.weight": rand(heads * hd, attn_in, gen=gen),
         f"{prefix}self_attn.k_proj.weight": rand(kv_heads * hd, attn_in, gen=gen),
         f"{prefix}self_attn.v_proj.weight": rand(kv_heads * hd, attn_in, gen=gen),
         f"{prefix}self_attn.o_proj.weight": rand(hidden, heads * hd, gen=gen),
         f"{prefix}mlp.gate_proj.weight": rand(inter, hidden, gen=gen),
         f"{prefix}mlp.up_proj.weight": rand(inter, hidden, gen=gen),
         f"{prefix}mlp.down_proj.weight": rand(hidden, inter, gen=gen),
         f"{prefix}post_attention_layernorm.weight": 1 + rand(hidden, gen=gen)}
    if input_norm:
        t[f"{prefix}input_layernorm.weight"] = 1 + rand(hidden, gen=gen)
    return t


def eagle_tensors(gen, hidden: int = H, num_layers: int = 2, **layer) -> dict:
    """An EAGLE (1/2) head: fc over [embedding, feature] with a bias, then Llama layers, the first without its
    input norm."""
    t = {"fc.weight": rand(hidden, 2 * hidden, gen=gen), "fc.bias": rand(hidden, gen=gen)}
    for i in range(num_layers):
        t.update(llama_layer_tensors(f"layers.{i}.", gen, hidden, input_norm=i > 0, hidden=hidden, **layer))
    return t


def eagle_config(hidden: int, vocab: int, num_layers: int, eagle3: bool = False, draft_vocab: int = 0,
                 heads: int = 4, kv_heads: int = 2, inter: int = 64) -> dict:
    """config.json of a head in the published layout."""
    cfg = dict(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv_heads,
               vocab_size=vocab, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128,
               num_hidden_layers=num_layers,
               architectures=["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLM"])
    if eagle3:
        cfg["draft_vocab_size"] = draft_vocab
    return cfg


def write_checkpoint(folder, config: dict, tensors: dict) -> str:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return str(folder)


def eagle3_tensors(gen, hidden: int = H, vocab: int = V, draft_vocab: int = DRAFT_V, target_hidden: int = 0,
                   **layer) -> dict:
    target_hidden = target_hidden or hidden
    tensors = {"fc.weight": rand(hidden, 3 * target_hidden, gen=gen),
               "midlayer.hidden_norm.weight": 1 + rand(hidden, gen=gen),
               "norm.weight": 1 + rand(hidden, gen=gen), "lm_head.weight": rand(draft_vocab, hidden, gen=gen),
               # draft id d -> target id d + d2t[d] = 2d: every other target token
               "d2t": torch.arange(draft_vocab, dtype=torch.int64),
               "t2d": torch.zeros(vocab, dtype=torch.bool)}
    tensors.update(llama_layer_tensors("midlayer.", gen, 2 * hidden, input_norm=True, hidden=hidden, **layer))
    return tensors


# ---- targets for engine tests (byte tokenizer: ids 0..255 bytes, 256 <eos>, ids past it decode to nothing) ----
TARGET_VOCAB, TARGET_HIDDEN = 320, 64
LETTERS = "abcdefghijklmnopqrstuvwxyz "


def _target_config(num_layers: int = 3):
    import transformers

    return transformers.LlamaConfig(vocab_size=TARGET_VOCAB, hidden_size=TARGET_HIDDEN, intermediate_size=128,
                                    num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=512, tie_word_embeddings=False)


def _save_target(model, folder) -> str:
    folder.mkdir(exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    byte_tokenizer().save_pretrained(folder)
    return str(folder)


def write_random_target(folder, seed: int = 0) -> str:
    """A tiny random Llama (weights std 0.2: logits far from uniform)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(_target_config()).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return _save_target(model, folder)


def write_random_heads(folder, seed: int = 5) -> tuple[str, str]:
    """A random 2-layer EAGLE head and a random EAGLE-3 head (a 160-token draft vocabulary, d2t: draft d -> target
    2d) over the tiny targets; their configs name a shorter max position (128) than the target's context."""
    gen = torch.Generator().manual_seed(seed)
    Ht, Vt = TARGET_HIDDEN, TARGET_VOCAB
    eagle = write_checkpoint(folder / "eagle", eagle_config(Ht, Vt, 2), eagle_tensors(gen, hidden=Ht, num_layers=2))
    eagle3 = write_checkpoint(folder / "eagle3", eagle_config(Ht, Vt, 1, eagle3=True, draft_vocab=160),
                              eagle3_tensors(gen, hidden=Ht, vocab=Vt, draft_vocab=160))
    return eagle, eagle3


def successor_map(seed: int = 7) -> dict[int, int]:
    """token id -> the id the successor target predicts after it: the letters and space in a cycle
    ('a' -> 'b' ... 'z' -> ' ' -> 'a'), every other id in one random cycle."""
    tok = byte_tokenizer()
    letters = [tok.convert_tokens_to_ids("Ġ" if c == " " else c) for c in LETTERS]
    gen = torch.Generator().manual_seed(seed)
    others = [i for i in range(TARGET_VOCAB) if i not in letters]
    others = [others[i] for i in torch.randperm(len(others), generator=gen).tolist()]
    succ = {}
    for cycle in (letters, others):
        for a, b in zip(cycle, cycle[1:] + cycle[:1]):
            succ[a] = b
    return succ


def write_successor_target(folder, seed: int = 7, layer_std: float = 0.1) -> str:
    """A Llama whose greedy next token is successor_map()[current token]: embedding rows of equal norm, the LM head's
    row for b the embedding of the token a with succ(a) = b (so the argmax of <norm(h), row> is succ(a) while h is
    mostly the embedding of a), and small random layers (std layer_std) that perturb the logits but rarely the
    argmax."""
    import transformers

    gen = torch.Generator().manual_seed(seed)
    model = transformers.LlamaForCausalLM(_target_config()).eval()
    Ht = TARGET_HIDDEN
    with torch.no_grad():
        embed = torch.randn(TARGET_VOCAB, Ht, generator=gen)
        embed = embed / embed.norm(dim=1, keepdim=True) * Ht ** 0.5
        model.model.embed_tokens.weight.copy_(embed)
        for p in model.model.layers.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * layer_std)
        head = torch.zeros(TARGET_VOCAB, Ht)
        for a, b in successor_map(seed).items():
            head[b] = embed[a] * (4 / Ht ** 0.5)
        model.lm_head.weight.copy_(head)
    return _save_target(model, folder)


def write_successor_head(folder, seed: int = 11, layer_scale: float = 0.8) -> str:
    """An EAGLE head (one layer) that predicts the successor target: fc passes the token's embedding through (its
    output read by the target's LM head gives succ(token)), plus random attention and MLP weights (std
    0.2 * layer_scale) whose context-dependent output makes some of its drafts wrong."""
    gen = torch.Generator().manual_seed(seed)
    Ht = TARGET_HIDDEN
    t = {k: v * layer_scale for k, v in eagle_tensors(gen, hidden=Ht, num_layers=1).items()}
    t["layers.0.post_attention_layernorm.weight"] = torch.ones(Ht)
    t["fc.weight"] = torch.cat([torch.eye(Ht), torch.zeros(Ht, Ht)], 1) + torch.randn(Ht, 2 * Ht, generator=gen) * 0.02
    t["fc.bias"] = torch.zeros(Ht)
    return write_checkpoint(folder, eagle_config(Ht, TARGET_VOCAB, 1), t)
