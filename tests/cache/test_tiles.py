"""Decode steps on the torch path read the payloads tile by tile (the default, :mod:`kvcomp.cache.tiles`):
for every codec of the matrix their logits equal those of the decoded copy (``decoded_copy=True``) within float32
rounding, after a chunked prefill (``exact_prefill``), a streaming one, with left padding and in beam search; a codec with a payload
reader then keeps no decoded copy. Tiles of 64 tokens, so that each read spans several tiles and segments."""

import pytest
import torch

from kvcomp.cache import CompressedCache
from kvcomp.codecs.base import reads_fused
from kvcomp.cache import tiles
from kvcomp.kernels.formats import RotaryPositions
from kvcomp.kernels.decode_attention import decode_attention_reference
from tests.codec_matrix import MATRIX, make_codec
from tests.helpers import reads_taken

pytestmark = pytest.mark.usefixtures("session_cache")
LENGTHS = (90, 70)  # row 1 left-padded by 20
STEPS = 24


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(tiles, "TILE_VALUES", 1)  # the fewest tokens per tile: 64


def _batch():
    gen = torch.Generator().manual_seed(5)
    width = max(LENGTHS)
    ids = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(LENGTHS):
        ids[i, width - n:], mask[i, width - n:] = torch.randint(1, 96, (n,), generator=gen), 1
    return ids, mask, torch.randint(1, 96, (len(LENGTHS), STEPS), generator=gen)


@torch.no_grad()
def _logits(model, cache, ids, mask, steps, chunk=None):
    """Logits of the prompt's last token and of every teacher-forced decode step; the prompt in ``chunk``-token
    forwards (None: one)."""
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    chunk = chunk or ids.shape[1]
    for start in range(0, ids.shape[1], chunk):
        stop = start + chunk
        last = model(ids[:, start:stop], attention_mask=mask[:, :stop], position_ids=positions[:, start:stop],
                     past_key_values=cache).logits[:, -1]
    out = [last]
    for t in range(steps.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        out.append(model(steps[:, t:t + 1], attention_mask=mask, position_ids=positions, past_key_values=cache).logits[:, -1])
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("protocol, chunk", [("exact_prefill", 32), ("streaming", None)])
@pytest.mark.parametrize("name", list(MATRIX))
def test_tiled_decode_steps_equal_the_decoded_copy(tiny_llama, name, protocol, chunk):
    codec = make_codec(tiny_llama, name)
    ids, mask, steps = _batch()
    tiled = CompressedCache(codec, protocol)
    with reads_taken() as reads:
        got = _logits(tiny_llama, tiled, ids, mask, steps, chunk)
    want = _logits(tiny_llama, CompressedCache(codec, protocol, decoded_copy=True), ids, mask, steps, chunk)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if reads_fused(codec, 0):  # every decode step read the payloads, and no decoded copy is left
        decode_reads = [read for _, read in reads[-len(LENGTHS) * 2:]]  # the last step: 2 row groups x 2 layers
        assert decode_reads == ["FusedDecode"] * len(decode_reads), decode_reads
        assert all(s.decoded.length == 0 for layer in tiled.compressed_layers for s in layer.streams)


@pytest.mark.parametrize("name", ["kivi", "int_token_head", "turboquant"])
def test_beam_search_on_tiles_equals_the_decoded_copy(tiny_llama, name):
    codec = make_codec(tiny_llama, name)
    ids = torch.randint(1, 96, (1, 80), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=12, num_beams=3, do_sample=False, pad_token_id=0)
    tiled = tiny_llama.generate(ids, past_key_values=CompressedCache(codec, "exact_prefill"), **kwargs)
    copied = tiny_llama.generate(ids, past_key_values=CompressedCache(codec, "exact_prefill", decoded_copy=True), **kwargs)
    assert torch.equal(tiled, copied)


def test_tiles_equal_the_reference_over_misaligned_segments():
    """Key and value segments cut at different tokens (KIVI-like: a per-channel key payload of 32-token groups, a
    per-token value payload ending elsewhere), pre-RoPE keys and a masked token: the reference's output."""
    from kvcomp.codecs.base import Payload
    from kvcomp.kernels.formats.uniform import UniformReader
    from kvcomp.stages.uniform_quantizer import GroupQuantizer

    gen = torch.Generator().manual_seed(0)
    b, h, d = 2, 2, 16
    keys_q, values_q = GroupQuantizer(2, 32, "per_channel"), GroupQuantizer(4, 8, "per_token")
    key_payload = Payload(keys_q.encode(torch.randn(b, h, 192, d, generator=gen)), 192)
    value_payload = Payload(values_q.encode(torch.randn(b, h, 200, d, generator=gen)), 200)
    key_tail, value_tail = torch.randn(b, h, 21, d, generator=gen), torch.randn(b, h, 13, d, generator=gen)

    def reader(payload, kind):
        quantizer = keys_q if kind == "key" else values_q
        return UniformReader.of(quantizer, payload, d)

    rope = RotaryPositions(torch.arange(213).expand(b, -1), 0, 1.0 / 10000 ** (torch.arange(0, d, 2) / d), 1.0,
                           torch.float32)
    valid = torch.ones(b, 213, dtype=torch.bool)
    valid[1, :40] = False  # left padding
    query = torch.randn(b, 4, d, generator=gen)
    got = tiles.decode_attention_tiles(query, [key_payload, key_tail], [value_payload, value_tail], h, 0.25,
                                              valid, rope, reader, tile=64)
    want = decode_attention_reference(query, [reader(key_payload, "key"), key_tail],
                                      [reader(value_payload, "value"), value_tail], 0.25, valid, rope)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
