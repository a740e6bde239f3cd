"""Two CSR measurements on the embedded SmolLM2-135M behind experiments/csr/README.md:

- the Jensen-Shannon divergence of adjacent layers' pre-RoPE keys and values (the layer-merging criterion) at
  200 / 50 / 20 bins, beside its noise floor (two halves of one layer's vectors);
- the relative squared error of the coded keys and values inside the cache after one 512-token prefill, for
  the first 256 tokens and the rest, with and without the online bank.

The codec is calibrated as ``run.py codec=csr`` calibrates it (the cached dictionaries are reused).

    python scripts/csr_diagnostics.py
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

ROOT = Path(__file__).resolve().parent.parent


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

    ids = token_windows(load_corpus("enwiki", "evaluation"), tokenizer, 512, 1, cache_tag="enwiki-evaluation")
    reference = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **with_cache(model, reference))
    for online in (256, 0):
        codec = build_codec(group_file(ROOT / "conf/codec/csr.yaml") | {"online_atoms": online}, info)
        calibrate(codec, calibration, lambda: calibration_data(model, tokenizer, calibration).activations(codec))
        cache = CompressedCache(codec, "exact_prefill")
        with torch.no_grad():
            model(ids, **with_cache(model, cache))
        for kind in ("key", "value"):
            first, rest = [], []
            for layer, plain in zip(cache.layers, reference.layers):
                original = plain.keys if kind == "key" else plain.values
                coded = (layer.key_stream if kind == "key" else layer.value_stream).materialize()
                error = (coded - original).square().sum(-1) / original.square().sum(-1)
                first.append(error[..., :256].mean().item())
                rest.append(error[..., 256:-1].mean().item())  # the last token is still exact
            print(f"in-cache relative error, online_atoms={online}, {kind}s: first 256 tokens "
                  f"{sum(first) / len(first):.3f}, the rest {sum(rest) / len(rest):.3f}")


if __name__ == "__main__":
    main()
