"""GGUF files written from a tiny HF model as llama.cpp's converter lays them out, for the GGUF loading tests."""


def gguf_writer(path: str, arch: str, cfg):
    """A gguf.GGUFWriter for `arch` with the shape metadata every architecture here writes (the caller adds its
    own keys, then calls write_hf_tensors)."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    return writer


def write_hf_tensors(writer, model_arch, hf, skip=(), convert=lambda name, data: data) -> None:
    """hf's tensors in F32 under llama.cpp's names for `model_arch` (a gguf.MODEL_ARCH), `convert`ed, then the file."""
    import gguf

    names = gguf.get_tensor_name_map(model_arch, hf.config.num_hidden_layers)
    for name, tensor in hf.state_dict().items():
        if name not in skip:
            writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), convert(name, tensor.float().numpy()))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
