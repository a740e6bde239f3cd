"""kvcomp.analysis.kv_statistics on synthetic data with known answers."""

import math
from collections import Counter

import pytest
import torch

from kvcomp.analysis import (
    adjacent_channel_correlation,
    chunk_vectors,
    discrete_entropy_bits,
    effective_rank,
    fisher_by_position,
    gaussian_entropy_per_float,
    joint_entropy_per_float,
    lag_correlation,
    quantize,
)

GAUSS_BITS_AT_QUARTER = 0.5 * math.log2(2 * math.pi * math.e) + 2  # h(N(0,1)) - log2(0.25)


def _uniform_bin_centres(shape, generator, bin_width=0.25, clip=4.0):
    """Values drawn uniformly from the centres of the 32 bins, so every bin has probability 1/32."""
    nbins = round(2 * clip / bin_width)
    idx = torch.randint(0, nbins, shape, generator=generator)
    return -clip + (idx.double() + 0.5) * bin_width


def _ar1(samples, heads, tokens, channels, rho, generator):
    noise = torch.randn(samples, heads, tokens, channels, generator=generator, dtype=torch.float64)
    x = torch.empty_like(noise)
    x[:, :, 0] = noise[:, :, 0]
    for t in range(1, tokens):
        x[:, :, t] = rho * x[:, :, t - 1] + math.sqrt(1 - rho**2) * noise[:, :, t]
    return x


def test_quantize_bins_and_clipping():
    z = torch.tensor([-10.0, -4.0, -3.9, -0.01, 0.0, 0.24, 0.25, 3.99, 4.0, 10.0])
    assert quantize(z).tolist() == [0, 0, 0, 15, 16, 16, 17, 31, 31, 31]


def test_chunk_vectors_layout():
    # x[s, h, t, c] = 1000 s + 100 h + 10 t + c
    s, h, t, c = torch.meshgrid(torch.arange(2), torch.arange(2), torch.arange(5), torch.arange(4), indexing="ij")
    x = 1000 * s + 100 * h + 10 * t + c
    temporal = chunk_vectors(x, 2, "temporal")
    assert temporal.shape == (2, 4, 2 * 2, 2)  # heads, channels, samples * (5 // 2), chunk
    assert temporal[1, 3, 0].tolist() == [103, 113]  # head 1, channel 3, tokens 0-1 of sample 0
    assert temporal[1, 3, 3].tolist() == [1123, 1133]  # tokens 2-3 of sample 1
    channel = chunk_vectors(x, 2, "channel")
    assert channel.shape == (2, 2, 2 * 5, 2)  # heads, channel groups, samples * tokens, chunk
    assert channel[0, 1, 6].tolist() == [1012, 1013]  # head 0, channels 2-3, sample 1 token 1


def test_entropy_of_uniform_discrete_data():
    g = torch.Generator().manual_seed(0)
    x = _uniform_bin_centres((64, 2, 512, 4), g)
    for axis in ("temporal", "channel"):
        for chunk in (1, 2):
            est = joint_entropy_per_float(x, chunk, axis, standardized=True)
            assert est.bits_per_float == pytest.approx(5.0, abs=0.02), (axis, chunk)
    one = joint_entropy_per_float(x, 1, "temporal", standardized=True)
    assert one.samples == 64 * 512
    assert joint_entropy_per_float(x, 2, "temporal", standardized=True).samples == 64 * 256
    assert joint_entropy_per_float(x, 2, "channel", standardized=True).samples == 64 * 512


def test_duplicated_temporal_pairs_halve_temporal_entropy_per_float():
    g = torch.Generator().manual_seed(1)
    half = _uniform_bin_centres((64, 1, 256, 4), g)
    x = half.repeat_interleave(2, dim=2)  # tokens 2k and 2k+1 identical
    single = joint_entropy_per_float(x, 1, "temporal", standardized=True).bits_per_float
    temporal = joint_entropy_per_float(x, 2, "temporal", standardized=True).bits_per_float
    channel = joint_entropy_per_float(x, 2, "channel", standardized=True).bits_per_float
    assert single == pytest.approx(5.0, abs=0.02)
    assert temporal == pytest.approx(single / 2, abs=0.02)
    assert channel == pytest.approx(single, abs=0.05)  # channels are independent


def test_entropy_of_gaussian_matches_differential_entropy():
    g = torch.Generator().manual_seed(2)
    x = 3.0 + 5.0 * torch.randn(8, 1, 4096, 2, generator=g)  # z-scored inside
    est = joint_entropy_per_float(x, 1, "temporal")
    assert est.bits_per_float == pytest.approx(GAUSS_BITS_AT_QUARTER, abs=0.03)
    assert gaussian_entropy_per_float(x, 1, "temporal") == pytest.approx(GAUSS_BITS_AT_QUARTER, abs=1e-6)


def test_miller_madow_reduces_small_sample_bias():
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 32, (200, 150, 1), generator=g)  # 200 distributions of 150 samples, true H = 5
    plugin = discrete_entropy_bits(codes, 32, miller_madow=False).mean().item()
    corrected = discrete_entropy_bits(codes, 32, miller_madow=True).mean().item()
    assert plugin < corrected
    assert abs(corrected - 5.0) < abs(plugin - 5.0) / 3


def test_entropy_hash_and_row_unique_paths_agree():
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 3, (2, 500, 40), generator=g)  # 3**40 * 2 cells overflow an int64 key
    codes[:, 250:] = codes[:, :250]
    short = torch.randint(0, 3, (2, 500, 3), generator=g)
    for c, nbins in ((codes, 3), (short, 3)):
        got = discrete_entropy_bits(c, nbins, miller_madow=False)
        for grp in range(2):
            counts = Counter(tuple(row) for row in c[grp].tolist())
            want = -sum(n / 500 * math.log2(n / 500) for n in counts.values())
            assert got[grp].item() == pytest.approx(want, abs=1e-9)


def test_max_samples_and_reduction():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3, 100, 8, generator=g)
    est = joint_entropy_per_float(x, 2, "channel", max_samples=50, reduction="none")
    assert est.samples == 50
    assert est.bits_per_float.shape == (3, 4)


def test_gaussian_entropy_of_ar1_pairs():
    g = torch.Generator().manual_seed(6)
    rho = 0.9
    x = _ar1(32, 1, 512, 4, rho, g)
    temporal = gaussian_entropy_per_float(x, 2, "temporal")
    channel = gaussian_entropy_per_float(x, 2, "channel")
    assert temporal == pytest.approx(GAUSS_BITS_AT_QUARTER + math.log2(1 - rho**2) / 4, abs=0.02)
    assert channel == pytest.approx(GAUSS_BITS_AT_QUARTER, abs=0.02)
    binned = joint_entropy_per_float(x, 2, "temporal").bits_per_float
    assert binned == pytest.approx(temporal, abs=0.1)


def test_effective_rank():
    assert effective_rank(torch.eye(7)) == pytest.approx(7.0)
    assert effective_rank(3.5 * torch.eye(7)) == pytest.approx(7.0)
    u, v = torch.randn(12, 1), torch.randn(1, 9)
    assert effective_rank(u @ v) == pytest.approx(1.0, abs=1e-6)
    assert effective_rank(torch.diag(torch.tensor([1.0, 1.0, 0.0, 0.0]))) == pytest.approx(2.0)
    assert effective_rank(torch.zeros(3, 3)) == 0.0


def test_lag_correlation_of_ar1_is_rho_to_the_lag():
    g = torch.Generator().manual_seed(7)
    rho = 0.8
    x = _ar1(32, 2, 400, 3, rho, g)
    r = lag_correlation(x, 4)
    assert r.shape == (4, 2, 3)
    for lag in range(1, 5):
        assert r[lag - 1].mean().item() == pytest.approx(rho**lag, abs=0.03)
    assert lag_correlation(x[:, 0], 2).shape == (2, 3)
    # channels of an AR(1) in time are independent
    assert adjacent_channel_correlation(x).abs().max().item() < 0.05


def test_adjacent_channel_correlation_known_value():
    g = torch.Generator().manual_seed(8)
    a = torch.randn(16, 1000, generator=g, dtype=torch.float64)
    b = 0.6 * a + 0.8 * torch.randn(16, 1000, generator=g, dtype=torch.float64)  # corr 0.6
    c = -b  # corr(b, c) = -1
    x = torch.stack([a, b, c], dim=-1)  # [samples, tokens, 3]
    r = adjacent_channel_correlation(x)
    assert r.shape == (2,)
    assert r[0].item() == pytest.approx(0.6, abs=0.02)
    assert r[1].item() == pytest.approx(-1.0, abs=1e-9)
    assert lag_correlation(x, 1)[0].abs().max().item() < 0.05  # white noise in time


def test_fisher_by_position():
    g2 = torch.ones(3, 2, 5, 4)
    g2[:, :, 0] = 1000.0
    g2[:, 1, 2] = 3.0  # head 1, token 2
    w = fisher_by_position(g2)
    assert w.shape == (5,)
    assert w.tolist() == pytest.approx([1000.0, 1.0, 2.0, 1.0, 1.0])
    assert fisher_by_position(g2[:, 0]).tolist() == pytest.approx([1000.0, 1.0, 1.0, 1.0, 1.0])


def test_bad_arguments():
    x = torch.randn(2, 10, 4)
    with pytest.raises(ValueError):
        joint_entropy_per_float(x, 2, "diagonal")
    with pytest.raises(ValueError):
        joint_entropy_per_float(torch.randn(10, 4), 1)
    with pytest.raises(ValueError):
        lag_correlation(x, 10)
