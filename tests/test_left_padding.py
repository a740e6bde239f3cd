"""Left padding: in a left-padded batch, each row's logits equal that row run alone.

Pad tokens never enter the encoded blocks: the batch's largest left padding ``P`` is kept with the
sinks (:attr:`KVStream.leading_pads`). The most-padded row therefore runs the same schedule as alone;
a row padded by ``p < P`` keeps ``P - p`` more of its first tokens in full precision, i.e. it equals
itself run alone with ``leading_pads = P - p``. Teacher-forced: a prefill, then 40 fixed decode tokens.
"""

import pytest
import torch
from transformers import DynamicCache

from kvcomp.cache import CompressedCache
from kvcomp.codecs import build_codec
from tests.codec_matrix import MATRIX, make_codec
from tests.conftest import info_of

LENGTHS = (30, 22)  # row 0 unpadded, row 1 padded by 8
STEPS = 40


@pytest.fixture(autouse=True)
def cache_home(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path_factory.getbasetemp() / "kvcomp-cache"))


def _inputs():
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(1, 96, (n,), generator=gen) for n in LENGTHS]
    width = max(LENGTHS)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
    return rows, ids, mask, torch.randint(1, 96, (len(rows), STEPS), generator=gen)


@torch.no_grad()
def _logits(model, cache, ids, mask, steps):
    """Logits of the real prefill positions' last token and of every teacher-forced step: ``[B, 1 + S, V]``."""
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    out = [model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache).logits[:, -1]]
    for t in range(steps.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        out.append(model(steps[:, t : t + 1], attention_mask=mask, position_ids=positions, past_key_values=cache).logits[:, -1])
    return torch.stack(out, dim=1)


def _alone(model, codec, row, steps, leading_pads=0, protocol="streaming"):
    cache = CompressedCache(codec, protocol)
    for layer in cache.layers:
        layer.key_stream.leading_pads = layer.value_stream.leading_pads = leading_pads
    return _logits(model, cache, row[None], torch.ones(1, len(row), dtype=torch.long), steps[None])[0]


def test_fp16_rows_equal_the_plain_cache_and_each_row_alone(tiny_model):
    rows, ids, mask, steps = _inputs()
    codec = build_codec({"name": "fp16"}, info_of(tiny_model))
    batch = _logits(tiny_model, CompressedCache(codec), ids, mask, steps)
    assert torch.equal(batch, _logits(tiny_model, DynamicCache(config=tiny_model.config), ids, mask, steps))
    for i, row in enumerate(rows):
        torch.testing.assert_close(batch[i], _alone(tiny_model, codec, row, steps[i]), rtol=1e-5, atol=1e-5)


# CSR's matching pursuit takes an argmax over atoms: a batched and a single-row matmul differ in the last
# float bits, which can flip a near-tie and change one vector's code (observed: 5 of 3,936 logits off by
# 1.5e-4 on tiny Qwen2). Its rows must agree to this looser bound; every other codec to 1e-4.
TOLERANCE = {"csr": 1e-3}


def _check_rows(model, codec, protocol="streaming"):
    tol = TOLERANCE.get(codec.name, 1e-4)
    rows, ids, mask, steps = _inputs()
    cache = CompressedCache(codec, protocol)
    batch = _logits(model, cache, ids, mask, steps)
    most = max(LENGTHS) - min(LENGTHS)
    assert all(layer.key_stream.leading_pads == most for layer in cache.layers)
    assert all(s.num_encoded > 0 for layer in cache.layers for s in (layer.key_stream, layer.value_stream))
    for i, row in enumerate(rows):
        pads = max(LENGTHS) - len(row)
        alone = _alone(model, codec, row, steps[i], most - pads, protocol)
        torch.testing.assert_close(batch[i], alone, rtol=tol, atol=tol)
    # the most-padded row runs exactly its own schedule
    padded = LENGTHS.index(min(LENGTHS))
    torch.testing.assert_close(batch[padded], _alone(model, codec, rows[padded], steps[padded], 0, protocol), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", [name for name in MATRIX if name != "fp16"])
def test_rows_of_a_left_padded_batch_equal_each_row_alone(tiny_model, name):
    _check_rows(tiny_model, make_codec(tiny_model, name))


@pytest.mark.parametrize("protocol", ["exact_prefill", "simulated"])
def test_left_padding_under_other_protocols(tiny_llama, protocol):
    _check_rows(tiny_llama, make_codec(tiny_llama, "kivi"), protocol)


def test_pads_are_never_encoded(tiny_llama):
    """Without the rule, KIVI's first key block would hold the pad tokens' keys (and their range)."""
    rows, ids, mask, steps = _inputs()
    cache = CompressedCache(make_codec(tiny_llama, "kivi"))
    _logits(tiny_llama, cache, ids, mask, steps[:, :1])
    stream = cache.layers[0].key_stream
    assert stream.num_sinks == max(LENGTHS) - min(LENGTHS) and stream.num_encoded > 0
