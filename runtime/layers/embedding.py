from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from braid.runtime.distributed import parallel_state as ps
from braid.runtime.layers.quantization import LinearMethod, get_linear_method


class VocabShard:
    """This TP rank's rows [start, start + rows) of a vocab-sized weight: ceil(vocab / tp) rows per rank, the last
    rank's tail past the vocab zero-padded (their logits are sliced off in compute_logits)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // ps.tp_size())
        self.start = ps.tp_rank() * self.rows
        self.stop = min(self.start + self.rows, vocab_size)  # real rows end here

    def load(self, loaded: torch.Tensor) -> torch.Tensor:
        """The rank's rows, padded to `rows`, of a checkpoint tensor: whole, or already sliced by the loader."""
        if loaded.shape[0] == self.vocab_size:
            loaded = loaded[self.start:self.stop]
        elif loaded.shape[0] != self.stop - self.start:
            raise ValueError(f"vocab-parallel weight: checkpoint has {loaded.shape[0]} rows, expected "
                             f"{self.vocab_size} or {self.stop - self.start}")
        if loaded.shape[0] == self.rows:
            return loaded
        return torch.cat([loaded, loaded.new_zeros(self.rows - loaded.shape[0], *loaded.shape[1:])])

    def rank_range(self, shape: list[int]) -> Optional[tuple[int, int, int]]:
        return (0, self.start, self.stop) if shape and shape[0] == self.vocab_size else None


class VocabEmbedding(nn.Module):
    """input ids [T] -> rows [T, hidden], times `scale` when given (Gemma: sqrt(hidden), rounded to the weight dtype
    first as HF does: 55.4256 is 55.5 in bf16). Under TP each rank holds a VocabShard of the rows; ids outside it
    give zero rows and the all-reduce fills them in."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: Optional[float] = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.scale = scale
        self.rounded_scale = scale  # set by build_cache once the weight's dtype is known
        self.shard = VocabShard(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.shard.rows, hidden_size), requires_grad=False)

    def load_shard(self, param, loaded: torch.Tensor, shard_id: int = 0) -> torch.Tensor:
        return self.shard.load(loaded)

    def rank_range(self, attr: str, shard_id, shape: list[int]) -> Optional[tuple[int, int, int]]:
        return self.shard.rank_range(shape)

    def build_cache(self, device) -> None:
        if self.scale is not None:
            self.rounded_scale = torch.tensor(self.scale, dtype=self.weight.dtype).item()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not ps.is_initialized():
            rows = F.embedding(input_ids, self.weight)
        else:
            local = input_ids - self.shard.start
            mine = (local >= 0) & (local < self.shard.rows)
            rows = F.embedding(torch.where(mine, local, 0), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
            rows = ps.all_reduce(rows)  # one rank holds each id's row, the others add zeros: exact
        return rows if self.scale is None else rows * self.rounded_scale


class LMHead(nn.Module):
    """hidden [N, hidden] -> logits [N, vocab] in fp32 (under TP [N, tp * ceil(vocab / tp)], the padding columns
    last: compute_logits cuts them). With tied embeddings the weight is the embedding's (assigned after
    construction; the dense method then multiplies by it). Under TP each rank multiplies its VocabShard of rows and
    the logits are all-gathered, so every rank samples from the same logits."""

    def __init__(self, vocab_size: int, hidden_size: int, logit_softcap: float = 0.0, *,
                 linear_method: Optional[LinearMethod] = None):
        super().__init__()
        self.logit_softcap = logit_softcap
        self.shard = VocabShard(vocab_size)
        self.linear_method = linear_method if linear_method is not None else get_linear_method()
        self.linear_method.create_weights(self, hidden_size, [self.shard.rows])

    def load_shard(self, param, loaded: torch.Tensor, shard_id: int = 0) -> torch.Tensor:
        return self.shard.load(loaded)

    def rank_range(self, attr: str, shard_id, shape: list[int]) -> Optional[tuple[int, int, int]]:
        return self.shard.rank_range(shape)

    def prepack_weights(self) -> None:
        """After loading (and tying): the method's post-load step (dense: a oneDNN-packed copy for CPU matmuls)."""
        self.linear_method.process_weights_after_loading(self)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear_method.apply(self, hidden)
        if self.logit_softcap and logits.is_cuda:  # the cast and the cap in one kernel (elementwise: before the gather)
            from braid.runtime.layers.gemma_kernels import soft_capped_fp32

            return ps.all_gather_last_dim(soft_capped_fp32(logits, self.logit_softcap))
        logits = ps.all_gather_last_dim(logits.float())
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits
