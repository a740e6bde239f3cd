"""Three CSR measurements on the embedded SmolLM2-135M behind experiments/csr/README.md:

- the Jensen-Shannon divergence of adjacent layers' pre-RoPE keys and values (the layer-merging criterion) at
  200 / 50 / 20 bins, beside its noise floor (two halves of one layer's vectors);
- the relative squared error of the coded keys and values inside the cache after one 512-token prefill, for
  the first 256 tokens and the rest, with and without the online bank;
- the same error for CSR and KIVI at equal bits per channel (CSR-8 vs KIVI-4, CSR-4 vs KIVI-2; CSR-6 at
  KIVI-2's bits per value), as a markdown table with each row's bits per value.

The codec is calibrated as ``run.py codec=csr`` calibrates it (the cached dictionaries are reused).

    python experiments/csr/diagnostics.py
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import DynamicCache

from kvcomp.cache import CompressedCache, install, with_cache
from kvcomp.calibration import calibrate
from kvcomp.codecs import ModelInfo, build_codec
from kvcomp.config import CalibrationConfig, group_file, typed
from kvcomp.data import load_corpus, token_windows
from kvcomp.models.fingerprint import model_fingerprint
from kvcomp.models.loading import load_model
from kvcomp.runner import calibration_data
from kvcomp.stages.layer_merging import layer_divergence

ROOT = Path(__file__).resolve().parents[2]  # the repository
TOKENS = 512
FIRST = 256  # tokens no codec keeps exact after the prefill (CSR's bank holds the last 256, KIVI the last 128 values)

# (row, codec file, overrides): CSR-s codes 32 s / head_dim bits per channel, 4 for CSR-8 and 2 for CSR-4 at head_dim
# 64; KIVI-b adds 1 bit per value of scales and zero-points, so CSR-6 (3 bits) matches KIVI-2's bits per value
EQUAL_BITS = [
    ("KIVI-4", "kivi", {"bits": 4}),
    ("CSR-8", "csr", {"sparsity": 8}),
    ("CSR-8, offline dictionary only", "csr", {"sparsity": 8, "online_atoms": 0}),
    ("KIVI-2", "kivi", {"bits": 2}),
    ("CSR-4", "csr", {"sparsity": 4}),
    ("CSR-4, offline dictionary only", "csr", {"sparsity": 4, "online_atoms": 0}),
    ("CSR-6", "csr", {"sparsity": 6}),
    ("CSR-6, offline dictionary only", "csr", {"sparsity": 6, "online_atoms": 0}),
]


def coded_cache(spec: dict, info: ModelInfo, model, tokenizer, calibration: CalibrationConfig,
                ids: torch.Tensor) -> CompressedCache:
    """The cache after one exact prefill of ``ids`` with the codec ``spec`` (calibrated as ``run.py`` does)."""
    codec = build_codec(spec, info)
    calibrate(codec, calibration, lambda: calibration_data(model, tokenizer, calibration).activations(codec))
    cache = CompressedCache(codec, "exact_prefill")
    with torch.no_grad():
        model(ids, **with_cache(model, cache))
    return cache


def relative_errors(cache: CompressedCache, reference: DynamicCache, tokens: slice) -> dict[str, float]:
    """Per kind, ``|x~ - x|^2 / |x|^2`` of each cached vector in ``tokens``, averaged over vectors and layers."""
    errors = {}
    for kind in ("key", "value"):
        per_layer = []
        for layer, plain in zip(cache.layers, reference.layers):
            original = plain.keys if kind == "key" else plain.values
            coded = (layer.key_stream if kind == "key" else layer.value_stream).materialize()
            error = (coded - original).square().sum(-1) / original.square().sum(-1)
            per_layer.append(error[..., tokens].mean().item())
        errors[kind] = sum(per_layer) / len(per_layer)
    return errors


def equal_bits_table(info: ModelInfo, model, tokenizer, calibration: CalibrationConfig, ids: torch.Tensor,
                     reference: DynamicCache) -> str:
    """Markdown: CSR and KIVI at equal bits per channel, their bits per value and in-cache relative errors."""
    lines = ["| codec | bits_per_value | bits_with_online_bank | bits_per_value_measured | key error, first "
             f"{FIRST} | value error, first {FIRST} | key error, all | value error, all |", "|---" * 8 + "|"]
    for row, file, overrides in EQUAL_BITS:
        cache = coded_cache(group_file(ROOT / f"conf/codec/{file}.yaml") | overrides, info, model, tokenizer,
                            calibration, ids)
        first = relative_errors(cache, reference, slice(0, FIRST))
        every = relative_errors(cache, reference, slice(0, -1))  # the last token is still exact
        bank = cache.codec.example_metrics(cache.statistics()).get("bits_with_online_bank")
        lines.append(f"| {row} | {cache.codec.bits_per_value():.2f} | {'-' if bank is None else f'{bank:.2f}'} | "
                     f"{cache.bits_breakdown()['bits_per_value_measured']:.2f} | {first['key']:.4f} | "
                     f"{first['value']:.4f} | {every['key']:.4f} | {every['value']:.4f} |")
    return "\n".join(lines)


def main() -> None:
    model, tokenizer = load_model("embedded", dtype="float32", device="cpu")
    install(model)
    info = ModelInfo.from_hf_config(model.config, name=group_file(ROOT / "conf/model/smollm2_135m.yaml")["name"],
                                    fingerprint=model_fingerprint(model, tokenizer)["fingerprint"])
    calibration = typed("calibration", OmegaConf.create(group_file(ROOT / "conf/calibration/enwiki.yaml")), CalibrationConfig)
    codec = build_codec(group_file(ROOT / "conf/codec/csr.yaml"), info)
    activations = calibration_data(model, tokenizer, calibration).activations(codec)
    for kind in ("key", "value"):
        layers = [activations.layer(i)[kind] for i in range(info.num_layers)]
        layers = [x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3]).float() for x in layers]
        for bins in (200, 50, 20):
            adjacent = [layer_divergence(a, b, bins) for a, b in zip(layers, layers[1:])]
            halves = [layer_divergence(x[:, ::2], x[:, 1::2], bins) for x in layers]
            print(f"JSD {kind}s, {bins} bins: adjacent layers {min(adjacent):.3f}-{max(adjacent):.3f}, "
                  f"halves of one layer {min(halves):.3f}-{max(halves):.3f}")

    ids = token_windows(load_corpus("enwiki", "evaluation"), tokenizer, TOKENS, 1, cache_tag="enwiki-evaluation")
    reference = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **with_cache(model, reference))
    for online in (256, 0):
        cache = coded_cache(group_file(ROOT / "conf/codec/csr.yaml") | {"online_atoms": online}, info, model,
                            tokenizer, calibration, ids)
        first = relative_errors(cache, reference, slice(0, FIRST))
        rest = relative_errors(cache, reference, slice(FIRST, -1))  # the last token is still exact
        for kind in ("key", "value"):
            print(f"in-cache relative error, online_atoms={online}, {kind}s: first {FIRST} tokens "
                  f"{first[kind]:.3f}, the rest {rest[kind]:.3f}")
    print(equal_bits_table(info, model, tokenizer, calibration, ids, reference))


if __name__ == "__main__":
    main()
