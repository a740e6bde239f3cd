"""A decode step makes the host wait for the device nowhere: no synchronising operation in kvcomp (fused
path under the Triton interpreter, torch path), nor in transformers' own step on the kvcomp attention
(its mask function does not read the padding mask on the host). Found on the CPU by
:class:`~kvcomp.cache.host_syncs.HostSyncs`; ``benchmarks/bench_decode_e2e.py`` counts them on a GPU."""

import types

import pytest
import torch

from kvcomp.cache import CompressedCache, install, with_cache
from kvcomp.cache.host_syncs import HostSyncs
from tests.codec_matrix import MATRIX, make_codec
from tests.helpers import encode_with_torch, reads_taken

pytestmark = pytest.mark.usefixtures("session_cache")

FUSED = ("kivi", "qjl", "temporalkv", "fp8", "int_token_head", "oscar", "eden", "turboquant")  # every payload format and rotation (turboquant: prod's sketches)
# CSR's online guard atoms pick the worst-coded vectors per row and head on the host (csr.py, _guard)
TORCH = tuple(name for name in MATRIX if name != "csr")
STEPS = 9  # more than a block of every codec of the matrix: the steps include encodes (checked)
FUSED_STEPS = 3  # the interpreter is slow; enough for an encode of each fused codec (checked)


def test_host_syncs_finds_what_would_synchronise_and_where():
    x = torch.randn(6)
    with HostSyncs() as found:
        x[x > 0], int(x.sum()), x.nonzero(), torch.repeat_interleave(torch.tensor([1, 2]))
        x[1:3], x[torch.tensor([0, 2])], x.repeat_interleave(2), x.sum()  # none of these
    assert [s.op for s in found.found] == ["index", "_local_scalar_dense", "nonzero", "repeat_interleave"]
    assert found.in_kvcomp == []  # issued by this test, not by kvcomp


def _decode_syncs(model, codec, check_finite, steps=STEPS) -> tuple[HostSyncs, CompressedCache]:
    ids = torch.randint(1, 96, (2, 37), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: transformers would read the padding mask on the host
    cache = CompressedCache(codec, "exact_prefill", check_finite=check_finite, capacity=37 + steps)
    syncs = HostSyncs()
    with torch.no_grad():
        token = model(ids, attention_mask=mask, **with_cache(model, cache)).logits[:, -1:].argmax(-1)
        encoded = _encoded(cache)
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            with syncs:
                token = model(token, attention_mask=mask, **with_cache(model, cache)).logits[:, -1:].argmax(-1)
    assert cache.get_seq_length() == 37 + steps
    assert codec.name == "fp16" or _encoded(cache) > encoded  # the synced steps encoded blocks
    return syncs, cache


def _encoded(cache) -> int:
    return sum(stream.num_encoded for layer in cache.layers for stream in layer.streams)


@pytest.fixture
def triton_llama(tiny_llama, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    encode_with_torch(monkeypatch)
    install(tiny_llama, "triton")
    yield tiny_llama
    install(tiny_llama, "torch")


@pytest.fixture(scope="module")
def fused_kivi(tiny_llama, tmp_path_factory):
    """KIVI's fused decode steps, run once for the two tests that check them: the syncs, the reads, and (spies that only
    record) each step's plans and the workspace partials its split kernels write."""
    pytest.importorskip("triton")
    from kvcomp.cache.attention import _INSTALLED
    from kvcomp.kernels import decode_plan

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVCOMP_CACHE", str(tmp_path_factory.getbasetemp() / "kvcomp-cache"))  # as session_cache does
        patch.setenv("TRITON_INTERPRET", "1")
        encode_with_torch(patch)
        install(tiny_llama, "triton")
        try:
            real, planned = decode_plan.plan_decode, []
            patch.setattr(decode_plan, "plan_decode",
                          lambda *inputs, **options: planned.append(inputs) or real(*inputs, **options))
            workspace = _INSTALLED[tiny_llama].workspace
            partials, scratch = [], workspace.scratch

            def spied(*args):
                partial, lse = scratch(*args)
                partials.append(partial)
                return partial, lse

            patch.setattr(workspace, "scratch", spied)
            codec = make_codec(tiny_llama, "kivi")
            with reads_taken() as taken:
                syncs, cache = _decode_syncs(tiny_llama, codec, "deferred", FUSED_STEPS)
            workspace_nbytes = workspace.nbytes
        finally:
            install(tiny_llama, "torch")
    return types.SimpleNamespace(codec=codec, syncs=syncs, cache=cache, taken=taken, planned=planned,
                                 partials=partials, workspace_nbytes=workspace_nbytes)


@pytest.mark.parametrize("name", FUSED)
def test_a_fused_decode_step_never_synchronises(name, request):
    if name == "kivi":  # the run the planning test checks too
        run = request.getfixturevalue("fused_kivi")
        codec, syncs, cache, taken = run.codec, run.syncs, run.cache, run.taken
    else:
        triton_llama = request.getfixturevalue("triton_llama")
        codec = make_codec(triton_llama, name)
        with reads_taken() as taken:
            syncs, cache = _decode_syncs(triton_llama, codec, "deferred", FUSED_STEPS)
    assert syncs.found == [], syncs.found
    per_forward = len(cache.layers) * len(cache.groups)  # one read per layer and row group
    steps = [read for _, read in taken][per_forward:]  # after the prefill
    assert len(steps) == FUSED_STEPS * per_forward and set(steps) <= {"FusedDecode", "FromSegments"}
    fused = any(codec.fused_attention_supported(layer) for layer in range(codec.model.num_layers))
    assert ("FusedDecode" in steps) == fused  # the split kernel where it reads the payload (else QJL's score kernel)


@pytest.mark.parametrize("name", TORCH)
def test_a_torch_path_decode_step_never_synchronises(tiny_llama, name):
    syncs, _ = _decode_syncs(tiny_llama, make_codec(tiny_llama, name), "deferred")
    assert syncs.found == [], syncs.found


def test_the_immediate_finiteness_check_synchronises_every_layer(tiny_llama):
    syncs, _ = _decode_syncs(tiny_llama, make_codec(tiny_llama, "kivi"), True, steps=2)
    where = {s.where.split(":")[0] for s in syncs.in_kvcomp}
    assert "kvcomp/cache/checks.py" in where  # the check of incoming K/V, 2 layers x 2 steps
    assert len([s for s in syncs.in_kvcomp if "_check_incoming" in s.where]) == 4


def test_a_fused_decode_step_is_planned_once_for_every_layer_and_runs_in_the_installations_workspace(fused_kivi):
    """flashinfer's ``plan`` once per step: one :func:`~kvcomp.kernels.decode_plan.plan_decode` per decode forward and
    row group, whatever the number of layers; every step's split kernels write the installation's workspace, which
    holds the same storage after the first step (KIVI's fused steps: the ``fused_kivi`` run)."""
    cache, planned, partials = fused_kivi.cache, fused_kivi.planned, fused_kivi.partials
    per_step = len(cache.groups) * len(cache.layers)
    assert len(cache.layers) > 1 and len(planned) == FUSED_STEPS * len(cache.groups)
    assert len(partials) == FUSED_STEPS * per_step  # every layer ran in it
    assert len({t.untyped_storage().data_ptr() for t in partials[per_step:]}) == 1 and fused_kivi.workspace_nbytes > 0
