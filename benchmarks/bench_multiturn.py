"""Multi-turn conversations with kvtc's store/restore mode: bytes stored between turns, time to
first token of the next turn (restore vs recompute vs an uncompressed cache kept) and the accuracy effect.

The embedded SmolLM2-135M (float32 on the CPU, or the hardware's dtype on a GPU) on conversations cut from
the embedded Wikipedia evaluation split: a prompt, then turns of new tokens (teacher forced). kvtc is
calibrated as ``run.py`` calibrates it (cached: the same artifact). See
:mod:`kvcomp.benchmarks.multiturn` for the protocol.

    python -m benchmarks.bench_multiturn --write                 # kvtc 16x, 4 conversations, BENCHMARKS.md
    python -m benchmarks.bench_multiturn --cr 8 --prompt 4096 --turns 4 --no-flush
"""

from __future__ import annotations

import argparse
import platform
import subprocess
from pathlib import Path

import torch
from omegaconf import OmegaConf

from kvcomp.benchmarks.multiturn import MultiTurnConfig, evaluate_multiturn
from kvcomp.cache import install
from kvcomp.calibration import calibrate
from kvcomp.codecs import ModelInfo, build_codec
from kvcomp.config import CalibrationConfig, group_file, typed
from kvcomp.data import load_corpus, token_windows
from kvcomp.models.fingerprint import model_fingerprint
from kvcomp.models.loading import load_model
from kvcomp.runner import calibration_data

from benchmarks.benchmarking import write_section

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Multi-turn store/restore with kvtc"


def measure(args) -> tuple[list[dict], dict]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_model("embedded", dtype="bfloat16" if device == "cuda" else "float32", device=device)
    install(model)
    codec_cfg = group_file(ROOT / "conf/codec/kvtc.yaml") | {"cr": args.cr}
    model_cfg = group_file(ROOT / "conf/model/smollm2_135m.yaml")  # the runner's identity: run.py's calibration is reused
    info = ModelInfo.from_hf_config(model.config, name=model_cfg["name"],
                                    fingerprint=model_fingerprint(model, tokenizer)["fingerprint"])
    codec = build_codec(codec_cfg, info)
    calibration = typed("calibration", OmegaConf.create(group_file(ROOT / "conf/calibration/enwiki.yaml")), CalibrationConfig)
    report = calibrate(codec, calibration, lambda: calibration_data(model, tokenizer, calibration).activations(codec))
    config = MultiTurnConfig(args.prompt, args.turn, args.turns, args.repeats, not args.in_memory, not args.no_flush)
    length = config.prompt_tokens + config.turns * config.turn_tokens
    conversations = token_windows(load_corpus("enwiki", "evaluation"), tokenizer, length, args.conversations,
                                  cache_tag="enwiki-evaluation")
    return evaluate_multiturn(model, codec, conversations, config), {"device": device, "codec": codec, "calibration": report}


def table(rows: list[dict]) -> str:
    lines = ["| turn | context tokens | kvtc stored KiB | uncompressed KiB (16-bit) | CR vs 16-bit | TTFT restore ms "
             "| TTFT recompute ms | TTFT uncompressed ms | recompute / restore | PPL turn, kvtc restored "
             "| PPL turn, uncompressed | top-1 agreement |", "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r['turn']} | {r['context_tokens']:.0f} | {r['stored_bytes'] / 1024:.1f} | {r['uncompressed_bytes_16bit'] / 1024:.1f} "
            f"| {r['uncompressed_bytes_16bit'] / r['stored_bytes']:.2f}x | {1000 * r['ttft_restore']:.1f} "
            f"| {1000 * r['ttft_recompute']:.1f} | {1000 * r['ttft_uncompressed']:.1f} "
            f"| {r['ttft_recompute'] / r['ttft_restore']:.2f}x | {r['ppl_restored']:.3f} | {r['ppl_uncompressed']:.3f} "
            f"| {r['agreement']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cr", type=float, default=16)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--turn", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--in-memory", action="store_true", help="store in CPU memory instead of a safetensors file")
    parser.add_argument("--no-flush", action="store_true", help="store the window uncompressed (as the cache holds it)")
    parser.add_argument("--write", action="store_true", help="replace the section of BENCHMARKS.md")
    args = parser.parse_args(argv)
    for name, least in (("cr", 1), ("prompt", 1), ("turn", 2), ("turns", 1), ("conversations", 1), ("repeats", 1)):
        if getattr(args, name) < least:  # before the model loads
            parser.error(f"--{name} must be at least {least}, got {getattr(args, name)}")
    rows, info = measure(args)
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    flags = " ".join(a for a in (argv if argv is not None else __import__("sys").argv[1:]))
    text = "\n".join([
        f"Command: `python -m benchmarks.bench_multiturn {flags}` at revision {revision}.",
        f"Machine: {info['device']} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads); "
        f"torch {torch.__version__}.", "",
        f"{info['codec'].describe()} on the embedded SmolLM2-135M; {args.conversations} conversations from the embedded "
        f"Wikipedia evaluation split: a {args.prompt}-token prompt, then {args.turns} turns of {args.turn} tokens. "
        f"Between turns the compressed cache ({'its window uncompressed' if args.no_flush else 'the window compressed too'}) "
        f"is {'kept in CPU memory' if args.in_memory else 'written to a safetensors file'} and restored for the next turn. Medians over conversations of the median of {args.repeats} repeats; "
        "perplexity of each turn's tokens pooled over conversations.", "",
        table(rows), "",
        "Stored = DEFLATE payloads + FP8 sinks + position ids (+ the window in the model dtype with --no-flush). TTFT restore = load + rebuild + the "
        "turn's forward, which decodes every block; recompute = prefill of history + turn; uncompressed = the turn's "
        "forward on a DynamicCache kept in memory.",
    ])
    if args.write:
        write_section(ROOT / "BENCHMARKS.md", SECTION, text)
    return text


if __name__ == "__main__":
    print(main())
