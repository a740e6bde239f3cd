"""Chunk layouts, codebook coding, normalisation and outliers: the stages the codebook codecs share."""

import pytest
import torch

from kvcomp.stages.codebook import ChunkLayout, CodebookQuantizer
from kvcomp.stages.normalization import MODES, ChannelStats, Normalizer, quantile
from kvcomp.stages.outliers import OutlierSelector

LAYOUTS = {
    "temporal": ChunkLayout(time_len=4, channel_len=1, group_channels=4),
    "channel": ChunkLayout(time_len=1, channel_len=4, group_channels=4),
    "scalar": ChunkLayout(time_len=1, channel_len=1, group_channels=4),
    "temporal_wide_group": ChunkLayout(time_len=2, channel_len=1, group_channels=8),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_round_trips(name):
    layout = LAYOUTS[name]
    x = torch.randn(2, 3, 16, 16)
    chunks = layout.to_chunks(x)
    assert chunks.shape[:2] == (3, 16 // layout.group_channels) and chunks.shape[-1] == layout.dim
    assert torch.equal(layout.from_chunks(chunks, 2, 16), x)
    codes = torch.randint(0, 256, chunks.shape[:3], dtype=torch.uint8)
    stored = layout.codes_to_storage(codes, 2, 16)
    assert stored.shape == (2, 3, 16 // layout.time_len, 16 // layout.channel_len)
    assert torch.equal(layout.codes_from_storage(stored), codes)


def test_temporal_chunk_is_l_tokens_of_one_channel_and_channel_chunk_l_channels_of_one_token():
    x = torch.randn(1, 1, 8, 8)
    temporal = LAYOUTS["temporal"].to_chunks(x)  # group 0 = channels 0..3
    assert torch.equal(temporal[0, 0, 0], x[0, 0, 0:4, 0])  # tokens 0-3 of channel 0
    assert torch.equal(temporal[0, 0, 1], x[0, 0, 0:4, 1])  # tokens 0-3 of channel 1
    assert torch.equal(temporal[0, 1, 0], x[0, 0, 0:4, 4])  # group 1 starts at channel 4
    channel = LAYOUTS["channel"].to_chunks(x)
    assert torch.equal(channel[0, 1, 2], x[0, 0, 2, 4:8])  # token 2, channels 4-7


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_quantizer_encodes_centroid_chunks_exactly(name):
    layout = LAYOUTS[name]
    k = 256 if layout.dim > 1 else 16
    quantizer = CodebookQuantizer(layout, k)
    torch.manual_seed(0)
    codebooks = torch.randn(3, 16 // layout.group_channels, k, layout.dim)
    n = layout.to_chunks(torch.zeros(2, 3, 16, 16)).shape[2]
    codes = torch.randint(0, k, (3, codebooks.shape[1], n))
    chunks = torch.gather(codebooks, 2, codes.unsqueeze(-1).expand(-1, -1, -1, layout.dim))
    x = layout.from_chunks(chunks, 2, 16)  # every chunk is exactly one centroid
    packed = quantizer.encode(x, codebooks)
    assert packed.dtype == torch.uint8
    assert torch.equal(quantizer.decode(packed, codebooks, 16), x)
    assert quantizer.bits_per_value(16) == pytest.approx(quantizer.code_bits / layout.dim)
    assert packed.numel() * 8 == x.numel() * quantizer.code_bits / layout.dim


def test_quantile_matches_torch():
    x = torch.randn(5, 301)
    for q in (0.005, 0.5, 0.995):
        assert torch.allclose(quantile(x, q), torch.quantile(x, q, dim=-1), atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_normalizer_round_trip(mode):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 10, 8) * torch.linspace(0.5, 4, 8) + 2.0
    stats = ChannelStats.of(x)
    normalizer = Normalizer(mode, torch.float32)
    z, scale, stored = normalizer.normalize(x, stats)
    assert torch.allclose(normalizer.denormalize(z, stats, stored), x, atol=1e-5)
    assert torch.allclose(z * scale, x - normalizer.denormalize(torch.zeros_like(z), stats, stored), atol=1e-5)
    if mode == "channel_zscore":
        assert z.mean((0, 2)).abs().max() < 1e-5
    if mode.startswith("token"):
        assert stored["token_scale"].shape == (2, 1, 10)
    assert normalizer.bits_per_value(3, 8) == pytest.approx(normalizer.stored_per_token * 32 / 24)


def test_outliers_keep_the_most_extreme_entries_per_token_exactly():
    torch.manual_seed(0)
    x = torch.randn(2, 2, 5, 50)
    stats = ChannelStats.of(torch.randn(4, 2, 100, 50))
    x[1, 0, 3, 7] = 40.0
    x[0, 1, 2, 11] = -35.0
    selector = OutlierSelector(0.01)
    assert selector.count(2, 50) == 1
    selected = selector.select(x, stats, "key")
    assert selected["outlier_index"].shape == (2, 1, 5, 1)
    mask = selector.mask(x, selected)
    assert mask[1, 0, 3, 7] and mask[0, 1, 2, 11] and mask.sum() == 2 * 5
    restored = selector.restore(torch.zeros_like(x), selected)
    assert restored[1, 0, 3, 7] == 40.0 and restored[0, 1, 2, 11] == -35.0
    assert (restored != 0).sum() == 10
    assert selector.paper_bits_per_value() == pytest.approx(0.16)
    assert selector.bits_per_value(2, 50) == pytest.approx(32 / 100)
    assert OutlierSelector(0.0).count(2, 50) == 0


@pytest.mark.parametrize("mode", MODES)
def test_normalize_moves_nothing_from_the_cpu_to_the_device_of_its_input(mode, monkeypatch):
    """With the statistics on the input's device, normalising a block copies no CPU tensor to that device: on
    a GPU each such copy synchronises the host (16 per decode step of ChannelKV on an H200,
    ``benchmarks/bench_decode_e2e.py``).
    The meta device stands in for the GPU."""
    x = torch.randn(2, 3, 8, 16)
    stats = ChannelStats(*(t.to("meta") for t in vars(ChannelStats.of(x)).values()))
    moved = []
    original = torch.Tensor.to

    def to(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.device.type == "cpu" and out.device.type == "meta":
            moved.append(tuple(self.shape))
        return out

    monkeypatch.setattr(torch.Tensor, "to", to)
    # range checks deferred, as a cache with check_finite="deferred" encodes
    z, scale, _ = Normalizer(mode, torch.float16).normalize(x.to("meta"), stats, range_checks=[])
    assert z.device.type == scale.device.type == "meta"
    assert moved == [(2, 3, 8, 16)]  # the test's own x only
