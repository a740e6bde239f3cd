"""Calibration time per codec family on the embedded SmolLM2-135M (CPU): the main job's calibration
(``enwiki``, 16 windows of 512 tokens), each codec at its defaults, fitted alone.

For each codec: the activation collection (forward passes, plus backward passes for Fisher weights; cached on
disk afterwards, so it is timed cold once per kind) and ``Codec.fit`` on it. Then one k-means fit of
TemporalKV-2 (layer 0 keys: 48 codebooks of 6048 4-token chunks, 256 centroids), the median of ``--repeats``.

    python -m benchmarks.bench_calibration               # every family, about 15 minutes on 2 cores
    python -m benchmarks.bench_calibration --write       # and replace its section of BENCHMARKS.md
    python -m benchmarks.bench_calibration --codecs none # only the k-means fit (e.g. of an older commit's kvcomp,
        # -P: the current folder not first on the path, so kvcomp is imported from the worktree:
        git worktree add ../old <commit> && PYTHONPATH=../old:. python -P -m benchmarks.bench_calibration --codecs none)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kvcomp.cache import install
from kvcomp.calibration import CalibrationConfig, CalibrationData
from kvcomp.codecs import ModelInfo, build_codec
from kvcomp.errors import at_least, unknown_choice
from kvcomp.models import load_model
from kvcomp.runner import calibration_data
from kvcomp.stages.normalization import ChannelStats

from benchmarks.benchmarking import write_section

FAMILIES = ("temporalkv", "kvquant", "channelkv", "aquakv", "kvtc", "csr")
SECTION = "## Calibration per codec family on 2 CPU cores"


def kmeans_fit_seconds(codec, data: CalibrationData, repeats: int) -> tuple[float, str]:
    """Median seconds of one k-means fit of ``codec``'s layer-0 key codebooks on its training windows."""
    acts = data.activations(codec)
    x = acts.layer(0)["key"].float()
    grad2 = acts.layer(0)["key_grad2"].float()
    usable = x.shape[2] // 8 * 8
    x, grad2 = x[:, :, :usable], grad2[:, :, :usable]
    train = max(1, round(codec.config.train_fraction * x.shape[0]))
    stats = ChannelStats.of(x)
    scheme = next(iter(codec.schemes("key", 0).values()))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        codebooks, _ = codec._fit_codebooks(scheme, "key", x[:train], grad2[:train], stats)
        times.append(time.perf_counter() - start)
    h, g, k, dim = codebooks.shape
    chunks = scheme.layout.to_chunks(x[:train]).shape[2]
    return statistics.median(times), f"{h * g} codebooks x {chunks} chunks of {dim}, k = {k}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", default=",".join(FAMILIES), help="comma-separated, or none: the k-means fit only")
    parser.add_argument("--threads", type=at_least(1), default=2)
    parser.add_argument("--repeats", type=at_least(1), default=3, help="k-means fits timed (median)")
    parser.add_argument("--write", action="store_true", help="replace the section of BENCHMARKS.md")
    args = parser.parse_args()
    unknown = [] if args.codecs == "none" else [n for n in args.codecs.split(",") if n not in FAMILIES]
    if unknown:  # before the model loads
        parser.error(str(unknown_choice("codec family", unknown[0], FAMILIES)))
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("embedded", dtype="float32", device="cpu")
    install(model)
    info = ModelInfo.from_hf_config(model.config)
    calibration = CalibrationConfig()
    rows, collected = [], set()
    for name in [] if args.codecs == "none" else args.codecs.split(","):
        codec = build_codec({"name": name}, info)
        kind = (codec.calibration_drop_first, codec.needs_fisher)
        data = calibration_data(model, tokenizer, calibration, force=kind not in collected)
        start = time.perf_counter()
        acts = data.activations(codec)
        collect = time.perf_counter() - start
        start = time.perf_counter()
        codec.fit(acts)
        fit = time.perf_counter() - start
        cold = "" if kind in collected else " (cold)"
        collected.add(kind)
        rows.append(f"| {name} | {collect:.1f}{cold} | {fit:.1f} |")
        print(rows[-1], flush=True)
    kmeans = ""
    if args.codecs == "none" or "temporalkv" in args.codecs.split(","):
        codec = build_codec({"name": "temporalkv"}, info)
        seconds, shape = kmeans_fit_seconds(codec, calibration_data(model, tokenizer, calibration), args.repeats)
        kmeans = f"\nOne TemporalKV-2 k-means fit (layer 0 keys: {shape}): {seconds:.2f} s, median of {args.repeats}.\n"
        print(kmeans, flush=True)
    body = (
        f"Embedded SmolLM2-135M, calibration `enwiki` ({calibration.num_samples} windows of {calibration.seq_len} "
        f"tokens), {args.threads} threads, torch {torch.__version__}; nothing else running.\n\n"
        "    python -m benchmarks.bench_calibration --write\n\n"
        "| codec (its defaults) | activations collected, s | fit, s |\n| --- | --- | --- |\n" + "\n".join(rows) + "\n" + kmeans
    )
    print(body)
    if args.write:
        write_section(Path(__file__).resolve().parents[1] / "BENCHMARKS.md", SECTION, body.rstrip())


if __name__ == "__main__":
    main()
