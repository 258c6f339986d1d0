"""Statistical checks of samplers: Pearson's chi-square of drawn tokens against the distribution they should follow."""

import torch

CHI2_DF5_P001 = 20.515  # the chi-square critical value for 5 degrees of freedom (a 6-token vocabulary) at p = 0.001


def chi_square(tokens: list[int], p: torch.Tensor) -> float:
    """tokens: draws over p's vocabulary; p: [V] their expected distribution -> the chi-square statistic over the
    tokens of positive probability (a drawn token of probability 0 fails at once)."""
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=p.shape[0]).double()
    expected = p.double() * len(tokens)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
