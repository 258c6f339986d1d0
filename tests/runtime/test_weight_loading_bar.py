"""The weight-loading progress bar: drawn with its real total on a terminal, never into a log file or pipe, and not
below INFO."""

import io
import logging
import sys

import torch

from braid.runtime.config import ServerArgs
from braid.runtime.loader import load_model_config
from braid.runtime.model_executor.model_loader import load_model


class Stream(io.StringIO):
    def __init__(self, terminal: bool):
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


def test_bar_only_on_a_terminal_at_info(tmp_path, monkeypatch, caplog):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    tensors = 2 * 9 + 3  # per layer: q, k, v, o, gate, up, down, two norms; embeddings, final norm, lm_head
    server_args = ServerArgs(model_path=str(tmp_path), load_format="safetensors")
    model_config = load_model_config(server_args)
    for terminal, level in ((True, logging.INFO), (False, logging.INFO), (True, logging.WARNING)):
        caplog.set_level(level, logger="braid.runtime.model_executor.model_loader")
        stream = Stream(terminal)
        monkeypatch.setattr(sys, "stderr", stream)
        load_model(model_config, server_args, torch.device("cpu"), torch.float32)
        written = stream.getvalue()
        if terminal and level == logging.INFO:
            assert f"Loading weights:   0%|          | 0/{tensors}" in written, written
        else:
            assert written == "", written
