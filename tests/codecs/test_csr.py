"""CSR: matching pursuit, NeuralDict, layer merging, the codec's bits, online bank and guard atoms
(spec seed-003-csr.md §7 items 1-4)."""

import json

import pytest
import torch
from transformers import DynamicCache

from kvcomp.cache import CompressedCache
from kvcomp.codecs import ModelInfo, build_codec
from kvcomp.codecs.base import StreamRequest, Unit, values_from_payload
from kvcomp.errors import ConfigError
from kvcomp.stages.layer_merging import PAPER_GROUPS, jensen_shannon, layer_divergence, merge_layers
from kvcomp.stages.neuraldict import DictTraining, diversity_loss, pursuit_loss, relative_mse, train_dictionaries
from kvcomp.stages.sparse_coding import (matching_pursuit, normalize_rows, orthogonal_matching_pursuit, reconstruct,
                                         sparse_weighted_sum)
from tests.codec_matrix import make_codec
from tests.helpers import load_script


def _atoms(g=3, n=48, d=16, seed=0, dtype=torch.float32):
    return normalize_rows(torch.randn(g, n, d, generator=torch.Generator().manual_seed(seed), dtype=dtype))


def _x(g=3, t=20, d=16, seed=1, dtype=torch.float32):
    return torch.randn(g, t, d, generator=torch.Generator().manual_seed(seed), dtype=dtype) * 3


def _dense(index, coefficient, n):
    """The sparse code as the dense ``r [G, T, N]`` of Eq. 1 (repeated atoms add up)."""
    r = torch.zeros(*index.shape[:2], n)
    return r.scatter_add_(-1, index, coefficient)


def test_mp_energy_identity_and_monotone_residual():
    atoms, x = _atoms(), _x()
    previous = x.square().sum(-1)
    for s in (1, 4, 8):
        index, coefficient = matching_pursuit(x, atoms, s)
        hat = reconstruct(index, coefficient, atoms)
        error = (x - hat).square().sum(-1)
        assert torch.allclose(error, x.square().sum(-1) - coefficient.square().sum(-1), atol=1e-4, rtol=1e-4)
        assert (error <= previous + 1e-4).all()
        previous = error
    assert coefficient.lt(0).any(), "coefficients are signed (C1)"


def test_mp_recovers_an_atom_equal_to_the_vector_in_one_step():
    atoms, x = _atoms(), _x()
    atoms[:, 7] = normalize_rows(x[:, 3])
    index, coefficient = matching_pursuit(x[:, 3:4], atoms, 4)
    assert (index[:, 0, 0] == 7).all()
    assert torch.allclose(coefficient[:, 0, 0], x[:, 3].norm(dim=-1))
    assert coefficient[:, 0, 1:].abs().max() < 1e-4
    assert torch.allclose(reconstruct(index, coefficient, atoms)[:, 0], x[:, 3], atol=1e-4)


def test_gram_mp_equals_direct_mp():
    atoms, x = _atoms(dtype=torch.float64).float(), _x(t=64).float()
    direct = matching_pursuit(x, atoms, 8, gram=False)
    gram = matching_pursuit(x, atoms, 8, gram=True)
    assert torch.equal(direct[0], gram[0])
    assert torch.allclose(direct[1], gram[1], atol=1e-5)


def test_omp_refits_coefficients_and_never_does_worse_than_mp():
    atoms, x = _atoms(), _x()
    index, coefficient = orthogonal_matching_pursuit(x, atoms, 4)
    residual = x - reconstruct(index, coefficient, atoms)
    chosen = atoms.gather(1, index.reshape(3, -1, 1).expand(-1, -1, 16)).view(3, 20, 4, 16)
    assert (chosen @ residual[..., None]).abs().max() < 1e-3  # the residual is orthogonal to every pick
    error = residual.square().sum(-1)
    first = matching_pursuit(x, atoms, 1)
    assert torch.equal(first[0][..., 0], index[..., 0])  # the same first pick, then a least-squares fit over more atoms
    assert (x - reconstruct(*first, atoms)).square().sum(-1).add(1e-4).ge(error).all()
    mp = reconstruct(*matching_pursuit(x, atoms, 4), atoms)
    assert error.mean() < (x - mp).square().sum(-1).mean()


def test_desparse_equals_dense_d_r_and_value_trick_equals_p_v():
    atoms, x = _atoms(), _x()
    index, coefficient = matching_pursuit(x, atoms, 6)
    index[:, :, 1] = index[:, :, 0]  # repeated atoms add up
    coefficient = coefficient.half()
    dense = _dense(index, coefficient.float(), atoms.shape[1]) @ atoms
    hat = reconstruct(index, coefficient, atoms)
    assert torch.allclose(hat, dense, atol=1e-5)
    probs = torch.softmax(torch.randn(3, 5, 20), -1)
    trick = sparse_weighted_sum(probs, index, coefficient, atoms.half())
    reference = probs @ reconstruct(index, coefficient, atoms.half())
    assert torch.allclose(trick, reference, rtol=1e-3, atol=1e-4)


def test_diversity_loss_and_training_lower_heldout_error():
    assert diversity_loss(torch.eye(8)[None]).item() == pytest.approx(0.0)
    assert diversity_loss(torch.ones(1, 4, 8) / 8**0.5).item() == pytest.approx(12 / 16)
    basis = torch.randn(2, 4000, 6, generator=torch.Generator().manual_seed(3))
    x = basis @ torch.randn(6, 16, generator=torch.Generator().manual_seed(4))  # vectors on a 6-dim subspace
    settings = DictTraining(atoms=12, sparsity=3, epochs=6, batch_size=512, kmeans_iters=3, lr=1e-2)
    trained = train_dictionaries(x, settings, "test")
    assert torch.allclose(trained.atoms.norm(dim=-1), torch.ones(2, 12), atol=1e-5)  # ReNorm
    assert trained.history[-1] < trained.history[0]  # below the k-means initialisation
    assert trained.heldout_mse.mean() <= min(trained.history) + 1e-6  # the best epoch of each dictionary is kept
    check = relative_mse(normalize_rows(x[:, :200]), trained.atoms, 3)
    assert float(check.mean()) < trained.history[0]
    atoms = torch.nn.Parameter(trained.atoms.clone())
    pursuit_loss(normalize_rows(x[:, :64]), atoms, 3).sum().backward()
    assert atoms.grad is not None and atoms.grad.abs().sum() > 0  # gradients flow through the coefficients


def test_layer_merging_groups_similar_layers():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2, 6000, 8, generator=gen) * torch.tensor([4.0, 1, 1, 1, 1, 1, 1, 1])
    b = torch.randn(2, 6000, 8, generator=gen) * torch.tensor([4.0, 1, 1, 1, 1, 1, 1, 1])
    c = torch.randn(2, 6000, 8, generator=gen) + torch.tensor([0, 0, 0, 0, 0, 0, 6.0, 0])
    assert jensen_shannon(torch.tensor([0.5, 0.5]), torch.tensor([0.5, 0.5])) == 0
    assert jensen_shannon(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])) == pytest.approx(1.0)
    assert layer_divergence(a, b, bins=20) < 0.05 < layer_divergence(a, c, bins=20)
    assert merge_layers([a, b, c, c], delta1=0.2, delta2=1.0, bins=20) == [[0, 1], [2, 3]]
    assert merge_layers([a, b, c], delta1=0.2, delta2=0.0, bins=20) == [[0], [1], [2]]  # Eq. 7's budget binds
    for kind, count in (("key", 11), ("value", 7)):  # the paper's groups: contiguous, every one of 32 layers once
        assert len(PAPER_GROUPS[kind]) == count and sum(PAPER_GROUPS[kind], []) == list(range(32))


MODEL = ModelInfo("m", num_layers=32, num_kv_heads=8, head_dim=128)


@pytest.mark.parametrize("s, bits", [(16, 4), (8, 2), (6, 1.5), (4, 1)])
def test_nominal_bits_match_the_paper_table(s, bits):
    codec = build_codec({"name": "csr", "sparsity": s}, MODEL)
    assert codec.code_bits_per_value("key", 0) == codec.code_bits_per_value("value", 31) == bits
    assert (codec.sparsity("key"), codec.sparsity("value")) == (s, s // 2)


@pytest.mark.parametrize("override, message", [
    ({"sparsity": 5}, "multiple of value_chunks"),
    ({"coder": "ksvd"}, "valid choices: mp, omp"),
    ({"merged_groups": "paper"}, "32-layer"),
    ({"online_sampling": "first"}, "valid choices: random, reverse_sequential"),
    ({"atoms": 40000}, "int16"),
    ({"value_chunks": 3}, "value_chunks must divide head_dim"),
    ({"key_chunks": 2, "sparsity": 6, "value_chunks": 4}, "multiple of value_chunks"),
])
def test_config_errors(override, message):
    model = ModelInfo("m", num_layers=30, num_kv_heads=3, head_dim=64)
    with pytest.raises(ConfigError, match=message):
        build_codec({"name": "csr", **override}, model)


pytestmark = pytest.mark.usefixtures("session_cache")


def _filled(model, codec, ids):
    cache = CompressedCache(codec, "exact_prefill")
    with torch.no_grad():
        model(ids, past_key_values=cache)
    return cache


def test_bits_count_codes_and_online_bank(tiny_llama):
    codec = make_codec(tiny_llama, "csr", guard_fraction=0.0)
    ids = torch.randint(1, 96, (2, 30), generator=torch.Generator().manual_seed(0))
    cache = _filled(tiny_llama, codec, ids)
    info = codec.model
    per_stream = {kind: 2 * info.num_kv_heads * 8 * info.head_dim // codec.chunks(kind) * 2 for kind in ("key", "value")}
    assert cache.state_nbytes == info.num_layers * sum(per_stream.values())  # 8 fp16 atoms per row and head
    encoded = 2 * info.num_kv_heads * 29 * info.head_dim  # the last token stays exact (C10)
    for layer in cache.layers:
        for stream in layer.streams:
            assert stream.num_encoded == 29 and stream.num_tail == 1
            assert 8 * stream.store.nbytes == encoded * codec.code_bits_per_value(stream.kind, 0)
    metrics = codec.example_metrics(cache.statistics())
    assert metrics["code_bits"] == pytest.approx(codec.bits_per_value())
    bank = sum(per_stream.values()) * info.num_layers / 2  # per batch row
    assert metrics["bits_with_online_bank"] == pytest.approx(codec.bits_per_value() + 8 * bank / (encoded / 2 * 2 * info.num_layers))
    assert codec.overhead_bits() == 16 * sum(a.numel() for atoms in codec.atoms.values() for a in atoms)


def test_online_bank_holds_the_last_prompt_tokens_and_moves_with_beam_reorder(tiny_llama):
    codec = make_codec(tiny_llama, "csr", guard_fraction=0.0)
    ids = torch.randint(1, 96, (3, 30), generator=torch.Generator().manual_seed(1))
    reference = DynamicCache(config=tiny_llama.config)
    with torch.no_grad():
        tiny_llama(ids, past_key_values=reference)
    cache = _filled(tiny_llama, codec, ids)
    streams = [s for layer in cache.layers for s in layer.streams]
    for stream, original in zip(streams, [t for layer in reference.layers for t in (layer.keys, layer.values)]):
        bank = stream.state.tensors["bank"]
        assert bank.shape[:3] == (3, codec.model.num_kv_heads, 8)
        assert torch.allclose(bank.float().norm(dim=-1), torch.ones(3, codec.model.num_kv_heads, 8), atol=1e-3)
        # reverse sequential: the bank holds the last prompt tokens, so token 28 (coded; 29 is still exact) is
        # recovered by its own atom in one step (values: both chunks), up to fp16 rounding
        decoded = stream.materialize()
        assert torch.allclose(decoded[:, :, 28], original[:, :, 28], rtol=2e-3, atol=2e-3), stream.kind
    before = [s.materialize().clone() for s in streams]
    banks = [s.state.tensors["bank"].clone() for s in streams]
    order = torch.tensor([2, 0, 1])
    cache.reorder_cache(order)
    for s, bank, x in zip(streams, banks, before):
        assert torch.equal(s.state.tensors["bank"], bank[order])
        s.forget_decoded()  # decode again from the reordered payloads and banks
        assert torch.allclose(s.materialize(), x[order], atol=1e-5)


def test_guard_atoms_code_outliers_exactly(tiny_llama):
    codec = make_codec(tiny_llama, "csr", guard_fraction=1.0, online_atoms=4, guard_quantile=0.9)
    x = torch.randn(1, codec.model.num_kv_heads, 20, codec.model.head_dim, generator=torch.Generator().manual_seed(2))
    state = codec.init_state(Unit(0, "key"), {(0, "key"): x})
    assert state.tensors["bank"].abs().sum() == 0 and state.tensors["guard_used"].sum() == 0
    payload = codec.encode(StreamRequest(0, "key", tokens=x, state=state))
    used = state.tensors["guard_used"]
    assert (used == 2).all()  # the 2 worst of 20 (above the 0.9 quantile)
    hat = codec.decode(payload, StreamRequest(0, "key", state=state, dtype=torch.float32))
    error = (hat - x).square().sum(-1) / x.square().sum(-1)
    exact = error < 1e-5
    assert (exact.sum(-1) >= 2).all()
    assert (payload.tensors["index"][..., 0][exact] >= codec.offline_atoms).all()  # coded by their guard atom
    payload = codec.encode(StreamRequest(0, "key", tokens=x[:, :, :1] * 50 + 3, state=state))  # decoding: more outliers, bank keeps filling
    assert (state.tensors["guard_used"] <= 4).all() and (state.tensors["guard_used"] >= 2).all()


def _renderer():
    return load_script("experiments/csr/render.py")


def test_render_dictionary_table(tmp_path):
    module = _renderer()
    record = {"layers": [0], "heldout_relative_mse": 0.05, "kmeans_relative_mse": 0.07, "epochs": 12, "seconds": 2.0,
              "epoch10_relative_mse": 0.06}
    results = {"overrides": ["codec.diversity=false"],
               "calibration": {"csr_dictionaries": {"key": [record, record | {"heldout_relative_mse": 0.07}]}}}
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "results.json").write_text(json.dumps(results))
    table = module.render(tmp_path)
    assert "| codec.diversity=false | key | 2 | 0.07 | 0.06 | - | 0.06 | 12 | 4 |" in table


def test_fused_desparse_decodes_like_the_dense_path_and_keeps_no_decoded_values(tiny_model):
    """``desparse=fused``: decode steps weight the coded values as D u (§5.4); greedy generation and logits match
    the dense path (Eq. 12), and the value streams hold no decoded copy."""
    ids = torch.randint(1, 96, (2, 24), generator=torch.Generator().manual_seed(4))
    logits = {}
    for mode in ("dense", "fused"):
        codec = make_codec(tiny_model, "csr", desparse=mode)
        assert values_from_payload(codec) == (mode == "fused")
        cache = CompressedCache(codec, "exact_prefill")
        steps = []
        with torch.no_grad():
            out = tiny_model(ids, past_key_values=cache)
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(6):
                out = tiny_model(token, past_key_values=cache)
                steps.append(out.logits[:, -1])
                token = out.logits[:, -1:].argmax(-1)
        logits[mode] = torch.stack(steps)
        decoded_values = sum(layer.value_stream.decoded.length for layer in cache.layers)
        assert (decoded_values == 0) == (mode == "fused")
    assert torch.allclose(logits["dense"], logits["fused"], atol=1e-4, rtol=1e-4)


def test_render_short_names():
    module = _renderer()
    described = build_codec({"name": "csr", "sparsity": 4, "online_atoms": 0}, MODEL).describe()
    assert module.short_name(described) == "CSR-4 online_atoms=0"
    assert module.short_name("kivi(bits=4, group_size=32)") == "KIVI-4" and module.short_name("fp16()") == "fp16"
