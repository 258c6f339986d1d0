from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from braid.runtime.layers.quantization import LinearMethod, get_linear_method


class VocabEmbedding(nn.Module):
    """input ids [T] -> rows [T, hidden], times `scale` when given (Gemma: sqrt(hidden), rounded to the weight dtype
    first as HF does: 55.4256 is 55.5 in bf16)."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: Optional[float] = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.scale = scale
        self.rounded_scale = scale  # set by build_cache once the weight's dtype is known
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def build_cache(self, device) -> None:
        if self.scale is not None:
            self.rounded_scale = torch.tensor(self.scale, dtype=self.weight.dtype).item()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(input_ids, self.weight)
        return rows if self.scale is None else rows * self.rounded_scale


class LMHead(nn.Module):
    """hidden [N, hidden] -> logits [N, vocab] in fp32. With tied embeddings the weight is the embedding's
    (assigned after construction; the dense method then multiplies by it)."""

    def __init__(self, vocab_size: int, hidden_size: int, logit_softcap: float = 0.0, *,
                 linear_method: Optional[LinearMethod] = None):
        super().__init__()
        self.logit_softcap = logit_softcap
        self.linear_method = linear_method if linear_method is not None else get_linear_method()
        self.linear_method.create_weights(self, hidden_size, [vocab_size])

    def prepack_weights(self) -> None:
        """After loading (and tying): the method's post-load step (dense: a oneDNN-packed copy for CPU matmuls)."""
        self.linear_method.process_weights_after_loading(self)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear_method.apply(self, hidden).float()
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits
