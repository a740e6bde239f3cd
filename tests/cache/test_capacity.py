"""Preallocated capacity: ``CompressedCache(capacity=N)`` reserves its buffers once, so decode steps within
``N`` tokens allocate no storage, and the cache decodes exactly as one that grows as needed."""

import contextlib

import pytest
import torch

from kvcomp.cache import CompressedCache, with_cache
from kvcomp.cache.growing import GrowingTensor
from kvcomp.errors import ConfigError
from tests.codec_matrix import MATRIX, make_codec

pytestmark = pytest.mark.usefixtures("session_cache")


class Allocations:
    """Counts the buffers growing tensors allocate (the ``allocations`` fixture patches it in)."""

    def __init__(self):
        self.count = 0

    @contextlib.contextmanager
    def per_forward(self, model):
        """Yields a list that gets the count at the start of each forward of ``model``."""
        counts = []
        handle = model.register_forward_pre_hook(lambda *_: counts.append(self.count))
        try:
            yield counts
        finally:
            handle.remove()


@pytest.fixture
def allocations(monkeypatch):
    counter, empty = Allocations(), GrowingTensor._empty

    def counted(self, *args):
        counter.count += 1
        return empty(self, *args)

    monkeypatch.setattr(GrowingTensor, "_empty", counted)
    return counter


def _tail_like(grown: GrowingTensor, steps: int, window: int, block: int, first: int = 40):
    """Feed ``grown`` as a stream's tail is fed: a prompt of ``first`` entries, then one entry per step, the
    oldest ``block`` dropped whenever ``window + block`` are live; checks the view against a list."""
    held = list(range(first))
    grown.append(torch.arange(first, dtype=torch.float32)[None])
    for step in range(first, first + steps):
        before = grown.view.clone()
        view = grown.view
        grown.append(torch.tensor([[float(step)]]))
        assert torch.equal(view, before)  # a view stays valid across the next append
        held.append(step)
        while len(held) >= window + block:
            grown.drop_front(block)
            held = held[block:]
        assert grown.view[0].tolist() == held


def test_a_reserved_tail_moves_between_two_buffers_without_allocating(allocations):
    grown = GrowingTensor(1, reserve=16 + 2 * 8 + 16, standby=True)
    _tail_like(grown, 5, window=16, block=8)
    assert allocations.count == 2  # the reserved buffer and its standby
    buffers = set()
    for _ in range(60):
        grown.append(torch.zeros(1, 1))
        if grown.length >= 24:
            grown.drop_front(8)
        buffers.add(grown.buffer.data_ptr())
    assert allocations.count == 2
    assert len(buffers) == 2
    assert grown.reserved_nbytes == 2 * 48 * 4 - grown.nbytes


def test_a_reserved_tail_holds_the_right_entries_over_many_moves(allocations):
    grown = GrowingTensor(1, reserve=16 + 2 * 8 + 16, standby=True)
    _tail_like(grown, 300, window=16, block=8)
    assert allocations.count == 2


def test_an_unreserved_tail_allocates_as_it_moves(allocations):
    grown = GrowingTensor(1)
    _tail_like(grown, 300, window=16, block=8)
    assert allocations.count > 10


def test_a_reserve_is_a_minimum_not_a_limit():
    grown = GrowingTensor(0, reserve=8)
    grown.append(torch.arange(5.0))
    assert grown.buffer.shape[0] == 8 and grown.standby is None  # no standby for a tensor that never drops
    grown.append(torch.arange(5.0, 30.0))
    assert grown.view.tolist() == list(range(30))
    grown.map(lambda t: t[:3])
    assert grown.view.tolist() == [0.0, 1.0, 2.0] and grown.buffer.shape[0] >= 8


def _generate(model, codec, capacity, steps, pads=5):
    ids = torch.randint(1, 96, (2, 37), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :pads] = 0
    cache = CompressedCache(codec, "exact_prefill", capacity=capacity)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             **with_cache(model, cache), pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    return out, cache


@pytest.mark.parametrize("name", list(MATRIX))
def test_a_preallocated_cache_decodes_the_same_and_allocates_nothing_in_decode(tiny_llama, name, allocations):
    codec = make_codec(tiny_llama, name)
    # 40 steps: the checked second half (forwards 20-38) holds a tail move between the two reserved buffers of every
    # codec with a window (block-1 codecs at 37, KIVI at 21 and 37, kvtc at 24, OSCAR at 22, ...) and, for a cache
    # that grows as needed, at least one allocation of every codec
    steps = 40
    grown_out, grown_cache = _generate(tiny_llama, codec, None, steps)
    with allocations.per_forward(tiny_llama) as counts:
        out, cache = _generate(tiny_llama, codec, 37 + steps, steps)
    assert torch.equal(out.sequences, grown_out.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, grown_out.logits))
    assert cache.nbytes == grown_cache.nbytes  # the same storage; the reservation is working memory
    # every buffer is reserved by the time the second block is encoded; after that, nothing grows
    late = counts[steps // 2:]
    assert late[-1] == late[0], f"{late[-1] - late[0]} buffers allocated in the last {len(late)} decode steps"


def test_without_capacity_the_same_decode_allocates(tiny_llama, allocations):
    """The check above, on a cache that grows as needed: its second half allocates."""
    with allocations.per_forward(tiny_llama) as counts:
        _generate(tiny_llama, make_codec(tiny_llama, "kivi"), None, 40)
    assert counts[-1] > counts[20]


def test_a_cache_beyond_its_capacity_grows(tiny_llama):
    codec = make_codec(tiny_llama, "kivi")
    grown, _ = _generate(tiny_llama, codec, None, 40)
    small, cache = _generate(tiny_llama, codec, 50, 40)
    assert torch.equal(small.sequences, grown.sequences)
    assert cache.get_seq_length() == 37 + 39


@pytest.mark.parametrize("capacity", [0, -3, 2.5, True, "64"])
def test_a_bad_capacity_is_refused(tiny_llama, capacity):
    with pytest.raises(ConfigError, match="capacity"):
        CompressedCache(make_codec(tiny_llama, "fp16"), capacity=capacity)


def test_a_long_first_append_moves_back_to_reserved_buffers(allocations):
    grown = GrowingTensor(1, reserve=48, standby=True)
    _tail_like(grown, 100, window=16, block=8, first=60)  # the prompt is longer than the reserve
    # the prompt's buffer and a standby; once the live entries fit, they move to the standby and a new
    # standby is made; then the two reserved buffers take turns
    assert allocations.count == 3
    assert grown.buffer.shape[1] == grown.standby.shape[1] == 48


def test_a_cache_that_encodes_the_prompt_only_reserves_its_tail_for_the_capacity(tiny_llama, allocations):
    codec = make_codec(tiny_llama, "kivi")
    ids = torch.randint(1, 96, (2, 37), generator=torch.Generator().manual_seed(0))
    cache = CompressedCache(codec, "exact_prefill", compress_generated=False, capacity=37 + 64)
    with allocations.per_forward(tiny_llama) as counts, torch.no_grad():
        tiny_llama.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0,
                            **with_cache(tiny_llama, cache))
    assert counts[-1] == counts[2]  # the generated tokens stay in the tail, which never grows
    assert all(s.num_tail >= 64 for layer in cache.layers for s in layer.streams)


def test_a_stored_cache_does_not_change_as_the_preallocated_cache_goes_on(tiny_llama):
    from kvcomp.cache.offload import store

    codec = make_codec(tiny_llama, "kivi")
    _, cache = _generate(tiny_llama, codec, 200, 8, pads=0)  # a left-padded cache is not stored
    stored = store(cache)
    before = {name: t.clone() for name, t in stored.tensors.items()}
    token = torch.zeros(2, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(60):  # the tail moves between its buffers several times
            tiny_llama(token, **with_cache(tiny_llama, cache))
    assert all(torch.equal(stored.tensors[name], t) for name, t in before.items())


def test_keeping_a_press_s_entries_rewrites_in_place_or_frees_a_mostly_empty_buffer():
    """:meth:`GrowingTensor.keep`: within a reserve the kept entries move to the front of the same buffer (nothing
    allocated); without one, a buffer that would be mostly empty is replaced by one that fits (the prompt's tail
    does not stay allocated after a press keeps 64 of 2000 tokens)."""
    kept = lambda t: t[:, :64]  # noqa: E731
    reserved = GrowingTensor(1, reserve=2048)
    reserved.append(torch.randn(2, 2000))
    buffer = reserved.buffer
    reserved.keep(kept)
    assert reserved.buffer is buffer and reserved.length == 64 and reserved.generation == 1
    grown = GrowingTensor(1)
    grown.append(torch.randn(2, 2000))
    before = grown.view[:, :64].clone()
    grown.keep(kept)
    assert grown.buffer.shape[1] <= 64 + 16 and torch.equal(grown.view, before)
    small = GrowingTensor(1)
    small.append(torch.randn(2, 40))
    buffer = small.buffer
    small.keep(lambda t: t[:, :30])
    assert small.buffer is buffer  # nearly full after the press: rewritten in place
