"""The batch sampler's exponential race (runtime/layers/race_sampling.py): the Triton kernels (under the interpreter
here, on the device in the GPU tier) draw the same tokens as the torch path, and seeded keys are distinct."""

import pytest
import torch

from braid.runtime.layers.race_sampling import race_draw, race_draw_kernels, seeded_keys


@pytest.mark.parametrize("vocab", [7, 5000])
def test_kernels_draw_what_the_torch_path_draws(vocab):
    torch.manual_seed(0)
    x = torch.randn(6, vocab) * 3
    x[2, : vocab // 2] = float("-inf")  # a masked half is never drawn
    scale = torch.tensor([1.0, 0.5, 2.0, 1.0, 10.0, 1.0])
    keys = torch.randint(0, 1 << 32, (6, 2), dtype=torch.int64)
    got = race_draw_kernels(x, scale, keys, block=1024)
    assert torch.equal(got, race_draw(x, scale, keys))
    assert got[2].item() >= vocab // 2


@pytest.mark.gpu
def test_kernels_on_the_device_at_llama3_vocabulary():
    torch.manual_seed(0)
    x = torch.randn(64, 128256, device="cuda")
    scale = torch.rand(64, device="cuda") + 0.5
    keys = torch.randint(0, 1 << 32, (64, 2), dtype=torch.int64, device="cuda")
    assert torch.equal(race_draw(x, scale, keys).cpu(), race_draw(x.cpu(), scale.cpu(), keys.cpu()))


def test_seeded_keys_are_distinct_over_seeds_and_steps():
    seeds = torch.tensor([0, 1, -1, 2**40, 2**63 - 1] * 4, dtype=torch.int64)
    steps = torch.tensor([0] * 5 + [1] * 5 + [2] * 5 + [100000] * 5, dtype=torch.int64)
    keys = seeded_keys(seeds, steps)
    assert len({tuple(k) for k in keys.tolist()}) == 20
    assert ((keys >= 0) & (keys < 2**32)).all()
