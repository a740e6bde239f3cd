"""RULER-like generation with and without the prefill memo (:mod:`kvcomp.benchmarks.prefill`) on an embedded model:
whether each codec's new tokens and metrics are the same, and the seconds per prompt of both (writes the "Prefill
memo" section of BENCHMARKS.md).

    python -m benchmarks.bench_prefill_memo --write
    python -m benchmarks.bench_prefill_memo --model qwen25_coder_05b --tokens 4096 --codecs fp16 kivi

Each codec runs one prompt of ``--tokens`` random token ids through a fresh cache under ``exact_prefill``, then
greedily ``--new`` tokens: first without the memo, then with it (the first codec records the prompt, the others
replay it). The first codec's memo row includes the recording.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from kvcomp.benchmarks.generation import eos_ids, generate_greedy
from kvcomp.benchmarks.prefill import PrefillMemo
from kvcomp.cache import install
from kvcomp.codecs import ModelInfo, build_codec, needs_calibration
from kvcomp.codecs.registry import CODECS
from kvcomp.errors import at_least
from kvcomp.models import load_model
from kvcomp.models.fingerprint import model_fingerprint

from benchmarks.benchmarking import write_section

SECTION = "## Prefill memo (RULER on a CPU)"
DEFAULT_CODECS = ("fp16", "kivi", "turboquant", "nvfp4", "int_token_head")


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2_135m", choices=["smollm2_135m", "qwen25_coder_05b"])
    parser.add_argument("--tokens", type=at_least(2), default=4096)
    parser.add_argument("--new", type=at_least(1), default=32)
    parser.add_argument("--codecs", nargs="+", default=list(DEFAULT_CODECS), choices=sorted(CODECS),
                        help="codecs that need no calibration, by name, at their defaults")
    parser.add_argument("--threads", type=at_least(1), default=1)
    parser.add_argument("--write", action="store_true", help="replace this section of BENCHMARKS.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("embedded", embedded=args.model)
    install(model)
    info = ModelInfo.from_hf_config(model.config, name=args.model, fingerprint=model_fingerprint(model, tokenizer)["fingerprint"])
    calibrated = [name for name in args.codecs if needs_calibration(build_codec({"name": name}, info))]
    if calibrated:
        raise SystemExit(f"--codecs: {', '.join(calibrated)} need a calibration; choose codecs that need none")
    ids = torch.randint(100, 20000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    memo, eos = PrefillMemo(budget=10**10), eos_ids(tokenizer, model)
    rows = []
    for name in args.codecs:
        runs = []
        for use in (None, memo):
            metrics, start = [], time.perf_counter()
            new = generate_greedy(model, build_codec({"name": name}, info), ids, max_new_tokens=args.new,
                                  eos_token_ids=eos, metrics=metrics, memo=use)
            runs.append((new, metrics[0], time.perf_counter() - start))
        (plain, plain_metrics, plain_s), (memoed, memo_metrics, memo_s) = runs
        rows.append(f"| {name} | {plain_s:.1f} | {memo_s:.1f} | {plain_s / memo_s:.1f}x | "
                    f"{'yes' if torch.equal(plain, memoed) and plain_metrics == memo_metrics else 'NO'} |")
    body = (f"`python -m benchmarks.bench_prefill_memo --model {args.model} --tokens {args.tokens} --new {args.new} "
            f"--threads {args.threads}` on this machine's CPU (float32): one prompt of {args.tokens} random tokens, "
            f"at most {args.new} new tokens per codec; seconds per prompt without and with the memo (the first "
            "codec's memo run records the prompt, the others replay it).\n\n"
            "| codec | seconds, prefill run | seconds, prefill replayed | speed-up | same tokens and metrics |\n"
            "|---|---:|---:|---:|---|\n" + "\n".join(rows))
    print(body)
    if args.write:
        write_section(Path(__file__).resolve().parent.parent / "BENCHMARKS.md", SECTION, body)
    return body


if __name__ == "__main__":
    sys.exit(main() and 0)
