"""Counter-based uniforms: exact integers against a plain-Python reference, rows that depend on their seed only,
and the moments and independence of uniform numbers."""

from __future__ import annotations

import math

import pytest
import torch

from hfmca_lightning.data.counter_random import CounterUniforms, counter_uniforms, hash32

MASK = 0xFFFFFFFF


def reference_hash(x: int) -> int:
    """lowbias32 with Python integers."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK
    return x ^ (x >> 16)


def reference_uniforms(seed: int, count: int, stream: int) -> list[float]:
    state = reference_hash(seed & MASK)
    state = reference_hash(state ^ (seed >> 32))
    state = reference_hash(state ^ (((stream + 1) * 0x9E3779B9) & MASK))
    words = [reference_hash(state ^ reference_hash(position)) for position in range(2 * count)]
    return [((words[2 * k] >> 5) * 2**26 + (words[2 * k + 1] >> 6)) / 2**53 for k in range(count)]


def test_the_hash_and_the_uniforms_equal_a_plain_python_reference():
    words = torch.randint(0, 2**32, (2000,), generator=torch.Generator().manual_seed(0))
    assert hash32(words).tolist() == [reference_hash(int(word)) for word in words]
    assert hash32(torch.tensor([0, MASK])).tolist() == [reference_hash(0), reference_hash(MASK)]
    seeds = torch.tensor([0, 1, 2**31, 2**32 + 5, 2**62 - 1, 2**63 - 1])
    for stream in (0, 3):
        got = counter_uniforms(seeds, 7, stream)
        for row, seed in zip(got.tolist(), seeds.tolist()):
            assert row == reference_uniforms(seed, 7, stream)


def test_a_row_depends_on_its_seed_only():
    seeds = torch.randint(0, 2**62, (6,), generator=torch.Generator().manual_seed(1))
    whole = counter_uniforms(seeds, 50)
    assert torch.equal(counter_uniforms(seeds.flip(0), 50), whole.flip(0))
    assert torch.equal(counter_uniforms(seeds[2:3], 50), whole[2:3])
    assert torch.equal(counter_uniforms(seeds, 80)[:, :50], whole)  # more numbers per seed extend the row
    assert not torch.equal(counter_uniforms(seeds, 50, stream=1), whole)


def test_the_numbers_are_uniform_and_independent():
    """10^5 numbers from 1,000 consecutive seeds: mean 1/2 and variance 1/12 within five standard errors, the
    largest distance of the empirical distribution from the uniform one (Kolmogorov-Smirnov) below its 0.1 % critical
    value, and no correlation between neighbouring positions or neighbouring seeds."""
    numbers = counter_uniforms(torch.arange(1000), 100)
    flat = numbers.flatten()
    n = flat.numel()
    assert bool((flat >= 0).all()) and bool((flat < 1).all())
    assert abs(float(flat.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(float(flat.var()) - 1 / 12) < 5 * math.sqrt(1 / 180 / n)
    ordered = flat.sort().values
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    assert float((ordered - grid).abs().max()) < 1.95 / math.sqrt(n)
    for left, right in ((numbers[:, :-1], numbers[:, 1:]), (numbers[:-1], numbers[1:])):
        correlation = torch.corrcoef(torch.stack([left.flatten(), right.flatten()]))[0, 1]
        assert abs(float(correlation)) < 5 / math.sqrt(left.numel())
    assert bool(((flat * 2**53) == (flat * 2**53).round()).all())  # 53-bit fractions


def test_counter_uniforms_hand_out_consecutive_numbers_of_each_view():
    seeds = torch.tensor([11, 12])
    uniforms = CounterUniforms(seeds, num_views=3, per_view=5)
    table = counter_uniforms(seeds, 15).view(6, 5)
    first = uniforms.rand((6, 2), torch.float64)
    scaled = uniforms.uniform((6,), -1.0, 3.0, torch.float64)
    torch.testing.assert_close(first, table[:, :2], rtol=0, atol=0)
    torch.testing.assert_close(scaled, table[:, 2] * 4.0 - 1.0, rtol=0, atol=0)
    assert uniforms.rand((6,)).dtype == torch.float32
    with pytest.raises(ValueError, match="one row per view"):
        uniforms.rand((5,))
    with pytest.raises(ValueError, match="more than 5 random numbers per view"):
        uniforms.rand((6, 2))


def test_float32_uniforms_stay_below_one_so_that_probability_one_always_happens():
    """Seed 1181012's ninth number is 1 - 2.1e-8, which float32 rounds up to 1: ``rand < 1.0`` (a blur of probability
    1, BYOL's first view) must still hold; every other number is the float64 one rounded as before."""
    uniforms = CounterUniforms(torch.tensor([1181012]), num_views=1, per_view=10)
    numbers = counter_uniforms(torch.tensor([1181012]), 10)[0]
    assert float(numbers[8]) > 1 - 2**-25 and float(numbers[8].float()) == 1.0  # the case
    drawn = uniforms.rand((1, 10))[0]
    assert float(drawn[8]) == 1 - 2**-24 and bool((drawn < 1.0).all())
    torch.testing.assert_close(drawn[:8], numbers[:8].float(), rtol=0, atol=0)
