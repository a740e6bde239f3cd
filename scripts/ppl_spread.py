"""How far a codec's perplexity moves under last-bit float noise: the main job's evaluation (embedded
SmolLM2, 32 windows of 512 tokens, both protocols) on the model as loaded and on copies whose every weight
is multiplied by ``1 +- 2^-23`` (one float32 ulp, random sign per value, seeded).

Another CPU (another BLAS or vector code path) changes the forward pass by about that much, so the spread
is how far that machine's digits may differ from these. Prints a Markdown table and the standard
deviation over the perturbed copies.

    python scripts/ppl_spread.py                      # KIVI-2, 4 perturbed copies (about 6 minutes on 2 cores)
    python scripts/ppl_spread.py --codec kivi --bits 4 --copies 2
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kvcomp.benchmarks.configs import PerplexityConfig
from kvcomp.benchmarks.perplexity import evaluate_perplexity, evaluation_windows
from kvcomp.cache import install
from kvcomp.codecs import CODECS, ModelInfo, build_codec
from kvcomp.config import ModelConfig
from kvcomp.errors import at_least
from kvcomp.models import load_model

PROTOCOLS = ("streaming", "simulated")


@torch.no_grad()
def perturb(model, seed: int) -> None:
    """Multiply every parameter by ``1 + s 2^-23`` with a random sign ``s`` per value."""
    generator = torch.Generator().manual_seed(seed)
    for parameter in model.parameters():
        signs = torch.randint(0, 2, parameter.shape, generator=generator).to(parameter.dtype) * 2 - 1
        parameter.mul_(1 + 2.0**-23 * signs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codec", default="kivi", choices=sorted(CODECS))
    parser.add_argument("--bits", type=at_least(1), default=2)
    parser.add_argument("--copies", type=at_least(1), default=4, help="perturbed copies (seeds 1..copies)")
    parser.add_argument("--threads", type=at_least(1), default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = PerplexityConfig(protocols=list(PROTOCOLS))
    rows = []
    for seed in range(args.copies + 1):
        model, tokenizer = load_model("embedded")
        install(model)
        if seed:
            perturb(model, seed)
        codec = build_codec({"name": args.codec, "bits": args.bits}, ModelInfo.from_hf_config(model.config))
        windows = evaluation_windows(config, tokenizer, ModelConfig())
        metrics = evaluate_perplexity(model, codec, windows, config)
        rows.append([f"seed {seed}" if seed else "as loaded", *(metrics[f"ppl_{p}"] for p in PROTOCOLS)])
        print(f"{rows[-1][0]}: " + ", ".join(f"{p} {v:.3f}" for p, v in zip(PROTOCOLS, rows[-1][1:])), flush=True)
    print(f"\n{codec.describe()}, {len(windows)} windows of {windows.shape[1]} tokens\n")
    print("| weights | " + " | ".join(f"PPL {p}" for p in PROTOCOLS) + " |")
    print("|---|" + "---|" * len(PROTOCOLS))
    for name, *values in rows:
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in values) + " |")
    if len(rows) > 2:
        spread = [statistics.stdev(row[i + 1] for row in rows[1:]) for i in range(len(PROTOCOLS))]
        print("| std over the perturbed copies | " + " | ".join(f"{s:.3f}" for s in spread) + " |")


if __name__ == "__main__":
    main()
