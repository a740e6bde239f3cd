"""Memory truth: what a compressed cache reports equals what it holds.

After a left-padded prefill (37 tokens: every matrix codec but fp16 encodes some of them) and 33 greedy decode steps
(several block flushes and buffer regrowths: every stream of both row groups encodes at least two blocks while
decoding, with every codec but fp16, KIVI's 16-token key blocks included), every tensor reachable from the cache is
collected (unique storages, so views count once) and its bytes must equal the cache's reported storage
(:attr:`nbytes`) + bookkeeping (position ids) + working memory (the decoded copy of ``decoded_copy=True`` and of
codecs without a payload reader, spare capacity of growing buffers, a preallocated cache's reservation: the
``capacity`` path) within 1 %, on every path: the torch path's tiles (the default), its decoded copy, the fused
path, ``decode_per_step``. Model-level tensors (the codec and its fitted state, the
model's weights and RoPE buffers) are not the cache's and are left out.

The fused path runs with the kernels' torch references (``backend="torch"`` inside the attention
function): what the cache keeps does not depend on which backend computes the step, and the Triton
interpreter would make 33 steps slow; the kernels themselves are tested against the references in
``test_decode_attention.py`` / ``test_qjl_kernel.py``.
"""

import types
from functools import partial

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvcomp.cache.reads as reads
from kvcomp.cache import CompressedCache, install
from kvcomp.cache.accounting import stream_values
from kvcomp.cache.memory import model_storages
from kvcomp.codecs import reads_fused, scores_from_payload
from tests.codec_matrix import MATRIX, make_codec
from tests.helpers import build_tiny, encode_with_torch, held_bytes

STEPS = 33  # the padded row (32 prompt tokens) reaches 64: two more 16-token KIVI key blocks
# tiles: the torch path's default (payloads read tile by tile); capacity: the torch path, storage preallocated
PATHS = ("tiles", "decoded_copy", "fused", "decode_per_step", "capacity")


pytestmark = pytest.mark.usefixtures("session_cache")


@pytest.fixture(scope="module")
def long_llama():
    return build_tiny(LlamaConfig, LlamaForCausalLM, max_position_embeddings=512)


def _run(model, codec, path, monkeypatch) -> CompressedCache:
    ids = torch.randint(1, 96, (2, 37), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    if path == "fused":  # the fused cache path, steps computed by the kernels' torch references
        monkeypatch.setattr(reads, "decode_attention", partial(_reference_decode_attention, reads.decode_attention))
        encode_with_torch(monkeypatch)
        if scores_from_payload(codec):
            monkeypatch.setattr(codec, "payload_scores", partial(_reference_scores, codec.payload_scores))
        install(model, kernel_backend="triton")
    cache = CompressedCache(codec, "exact_prefill", decode_per_step=path == "decode_per_step",
                            decoded_copy=path == "decoded_copy", capacity=37 + STEPS if path == "capacity" else None)
    try:
        with torch.no_grad():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                past_key_values=cache, pad_token_id=0,
            )
    finally:
        install(model, kernel_backend="torch")
    return cache


def _reference_decode_attention(original, query, keys, values, scale, valid=None, key_rope=None, backend="torch", num_splits=None,
                                step=None):
    return original(query, keys, values, scale, valid, key_rope, "torch")


def _reference_scores(original, query, payload, layer_idx, backend="torch"):
    return original(query, payload, layer_idx, "torch")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(MATRIX))
def test_reported_memory_equals_held_memory(long_llama, name, path, monkeypatch):
    codec = make_codec(long_llama, name)
    if path == "fused" and not (scores_from_payload(codec) or reads_fused(codec, 0)):
        pytest.skip(f"{name} has no fused decode path")
    cache = _run(long_llama, codec, path, monkeypatch)
    assert cache.get_seq_length() == 37 + STEPS - 1
    held = held_bytes(cache, model_storages(long_llama))
    reported = cache.nbytes + cache.bookkeeping_nbytes + cache.working_nbytes
    assert held == pytest.approx(reported, rel=0.01), (held, cache.nbytes, cache.bookkeeping_nbytes, cache.working_nbytes)
    streams = [s for layer in cache.layers for s in layer.streams]  # every row group's
    if name != "fp16":
        assert all(s.num_encoded > 0 for s in streams)
    decodes_values = path == "fused" and scores_from_payload(codec)  # QJL's fused path scores keys, decodes values
    no_copy = path in ("fused", "decode_per_step") or (path == "tiles" and reads_fused(codec, 0))
    if no_copy:  # no decoded copy: everything held besides storage is spare capacity
        assert all(s.decoded.length == 0 for s in streams if not (decodes_values and s.kind == "value"))
    if path == "decoded_copy" and name != "fp16":
        assert any(s.decoded.length > 0 for s in streams)
    if name != "fp16" and no_copy and not decodes_values:
        # what the compressed cache holds is less than the full-precision K/V it replaces (fp32 tiny model)
        assert held < sum(stream_values(s) for s in streams) * 4


def test_walker_counts_views_once_and_finds_closures():
    base = torch.zeros(100)
    holder = types.SimpleNamespace(a=base[:10], b=[base[50:]], c=(lambda: base), d={"x": torch.ones(3)})
    assert held_bytes(holder, set()) == 400 + 12
    assert held_bytes(holder, {base.untyped_storage().data_ptr()}) == 12


def test_csr_value_path_holds_no_decoded_values(long_llama, monkeypatch):
    """CSR with ``desparse=fused``: decode steps weight the coded values as D u, so the value streams keep no
    decoded copy, and what the cache reports is still what it holds."""
    codec = make_codec(long_llama, "csr", desparse="fused")
    cache = _run(long_llama, codec, "tiles", monkeypatch)
    held = held_bytes(cache, model_storages(long_llama))
    assert held == pytest.approx(cache.nbytes + cache.bookkeeping_nbytes + cache.working_nbytes, rel=0.01)
    assert all(layer.value_stream.decoded.length == 0 for layer in cache.layers)
    assert all(layer.key_stream.decoded.length > 0 for layer in cache.layers)
