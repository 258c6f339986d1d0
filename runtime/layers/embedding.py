from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from braid.runtime.layers import cpu_gemm, triton_gemv


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """hidden [N, hidden] -> logits [N, vocab] in fp32. With tied embeddings the weight is the embedding's."""

    def __init__(self, vocab_size: int, hidden_size: int, logit_softcap: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.logit_softcap = logit_softcap
        self._packed = None

    def prepack_weights(self) -> None:
        """After loading (and tying): a oneDNN-packed copy of the weight for CPU matmuls (no-op elsewhere)."""
        self._packed = cpu_gemm.PackedLinearWeight.pack(self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if triton_gemv.decode_gemv_applies(hidden, self.weight):
            logits = triton_gemv.gemv(hidden, self.weight)[0].float()
        else:
            logits = cpu_gemm.linear(hidden, self.weight, None, self._packed).float()
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits
