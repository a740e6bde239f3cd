"""How far each layer's pre-RoPE keys sit from zero: per layer, the norm of the keys' mean over tokens
(the constant offset, e.g. from k_proj biases) divided by the mean norm of their deviation from it; the median
and maximum over layers, then every layer's ratio in layer order.

    python scripts/key_offsets.py --model smollm2_135m qwen25_coder_05b [--tokens 256]

A large ratio means per-token quantizers (HIGGS, QJL's sketches, per-token scales) spend their range on
the offset; per-channel keys (KIVI) subtract it. Reads the first held-out Wikipedia articles.
"""

import argparse

import torch

from kvcomp.data import load_corpus
from kvcomp.data.assets import EMBEDDED_MODELS
from kvcomp.errors import at_least
from kvcomp.models import load_model

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["smollm2_135m"], choices=sorted(EMBEDDED_MODELS),
                        help="embedded model keys")
    parser.add_argument("--tokens", type=at_least(1), default=256)
    args = parser.parse_args()
    text = " ".join(load_corpus("enwiki", "evaluation")[:3])
    for key in args.model:
        model, tokenizer = load_model("embedded", embedded=key, dtype="float32", device="cpu")
        ids = tokenizer(text, return_tensors="pt")["input_ids"][:, : args.tokens]
        keys = []
        hooks = [layer.self_attn.k_proj.register_forward_hook(lambda m, i, out: keys.append(out[0]))
                 for layer in model.model.layers]
        with torch.no_grad():
            model(ids)
        by_layer = [(k.mean(0).norm() / (k - k.mean(0)).norm(dim=-1).mean()).item() for k in keys]
        ratios = sorted(by_layer)
        print(f"{key}: offset / deviation norm over {len(ratios)} layers: median {ratios[len(ratios) // 2]:.2f}, "
              f"max {ratios[-1]:.2f}")
        print(f"  by layer: {' '.join(f'{r:.1f}' for r in by_layer)}")
