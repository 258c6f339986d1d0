"""A byte-level tokenizer without merges (ids 0..255 and an eos) for tiny random checkpoints, so a test folder needs
nothing from elsewhere (the GPU machine has no SmolLM2 package); ids past it decode to nothing."""


def byte_tokenizer(eos_token: str = "<eos>"):
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab[eos_token] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token)
