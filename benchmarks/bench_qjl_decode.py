"""Decode-step timing of QJL's payload-scored attention vs PyTorch SDPA on bf16 K/V (GPU benchmark).

Llama-3.1-8B attention shapes (32 query heads, 8 KV heads, head_dim 128), one decode query per sequence,
contexts 8K..64K. For each shape it times, with CUDA events after a warm-up, the median over repetitions:

- ``sdpa``: ``F.scaled_dot_product_attention`` over bf16 K/V (the flash / efficient kernel);
- ``bf16 scores``: ``q K^T`` alone on bf16 keys (what the QJL kernel replaces);
- ``qjl scores``: the Triton kernel's logits from the packed sign bits (``m`` bits + norms per key);
- ``qjl step``: QJL scores + softmax + ``P V``. Where the groups are a power of two of at least 16
  tokens (every preset), one fused decode-attention launch (:mod:`kvcomp.kernels.decode_attention_triton`, split + merge) scores the sign
  bits and weights the packed 2-bit values, so no bf16 K or V exists; otherwise the score kernel, then
  softmax and ``P V`` over values decoded to bf16.

Every repetition uses a fresh random query and rotates between several independently drawn K/V sets
whose total size exceeds the L2 cache, so small shapes are not flattered. Payload bytes per key token are
printed beside each row. ``--write`` replaces the QJL section of BENCHMARKS.md with the table.

    python -m benchmarks.bench_qjl_decode --write          # on a CUDA GPU
    TRITON_INTERPRET=1 python -m benchmarks.bench_qjl_decode --smoke   # CPU check of the script itself
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from kvcomp.codecs import ModelInfo, build_codec
from kvcomp.codecs.base import StreamRequest
from kvcomp.errors import at_least
from kvcomp.kernels.decode_attention import decode_attention, decode_attention_reference, relative_error
from kvcomp.kernels.qjl_scores import qjl_scores_reference

from benchmarks.benchmarking import (LLAMA31_8B, SMOKE_SHAPE, Timer, buffer_sets, device_name, l2_cache_bytes,
                                     publish, revision, script_device)

SECTION = "## QJL decode-step scores"
SETTINGS = {  # name -> codec config (head_dim 128)
    "qjl authors' general layer (m=256, m_o=256, 8 outliers)": {"name": "qjl", "initial_layers": 0},
    "qjl with a smaller sketch, not a preset (m=224, m_o=64, 8 outliers)": {
        "name": "qjl", "initial_layers": 0, "sketch_dim": 224, "outlier_sketch_dim": 64,
    },
}


def bench_shape(codec, batch: int, context: int, timer: Timer, device: torch.device, l2_bytes: int,
                shape: dict = LLAMA31_8B) -> list[dict]:
    h, hq, d = shape["kv_heads"], shape["query_heads"], shape["head_dim"]
    kv_bytes = 2 * batch * h * context * d * 2
    sets = []
    for _ in range(buffer_sets(kv_bytes, l2_bytes)):
        keys = torch.randn(batch, h, context, d, device=device, dtype=torch.bfloat16)
        keys[..., :4] *= 6  # a few large channels, as real keys have
        values = torch.randn(batch, h, context, d, device=device, dtype=torch.bfloat16)
        sets.append((keys, values, codec.encode(StreamRequest(0, "key", tokens=keys)), codec.encode(StreamRequest(0, "value", tokens=values))))
    turn = iter(range(10**9))

    def inputs():
        keys, values, key_payload, value_payload = sets[next(turn) % len(sets)]
        query = torch.randn(batch, hq, 1, d, device=device, dtype=torch.bfloat16)
        return query, keys, values, key_payload, value_payload

    def sdpa(q, k, v, *_):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def bf16_scores(q, k, *_):
        return q.view(batch, h, hq // h, d) @ k.transpose(-1, -2)

    def qjl_scores(q, _k, _v, key_payload, _vp):
        return codec.payload_scores(q, key_payload, 0, "triton")

    fused = codec.fused_attention_supported(0)  # groups of 2^k >= 16 tokens: the fused decode kernel
    decoded_values = {} if fused else {id(s[3]): codec.decode(s[3], StreamRequest(0, "value", dtype=torch.bfloat16)) for s in sets}

    def qjl_step(q, _k, _v, key_payload, value_payload):
        if fused:  # sign-bit scores, softmax and P V over the packed 2-bit values in one kernel + merge
            keys, values = [codec.payload_reader(key_payload, "key", 0)], [codec.payload_reader(value_payload, "value", 0)]
            return decode_attention(q[:, :, 0], keys, values, d**-0.5, backend="triton")
        logits = codec.payload_scores(q, key_payload, 0, "triton") * d**-0.5
        probs = torch.softmax(logits, dim=-1).to(torch.bfloat16)
        return probs.view(batch, h, hq // h, context) @ decoded_values[id(value_payload)]

    errors = check(codec, batch, context, device, fused, hq)
    key_bytes = sets[0][2].nbytes / (batch * h * context)
    value_bytes = sets[0][3].nbytes / (batch * h * context) if fused else d * 2
    rows = []
    baseline = timer(sdpa, inputs)
    for name, fn, bytes_per_key in (
        ("sdpa (bf16 K/V)", sdpa, 2 * d * 2),
        ("bf16 scores q.K^T", bf16_scores, d * 2),
        ("qjl scores (Triton)", qjl_scores, key_bytes),
        ("qjl step, fused (scores+softmax+PV from packed values)" if fused else
         "qjl step (scores kernel, softmax + PV on decoded bf16 values)", qjl_step, key_bytes + value_bytes),
    ):
        ms = baseline if fn is sdpa else timer(fn, inputs)
        rows.append({"batch": batch, "context": context, "method": name, "ms": ms, "vs_sdpa": baseline / ms,
                     "bytes_per_token_head": bytes_per_key, "error": errors.get(fn.__name__, float("nan"))})
    return rows


def check(codec, batch: int, context: int, device: torch.device, fused: bool, hq: int) -> dict:
    """Relative errors ``||out - ref|| / ||ref||`` of the score kernel and the step on fresh random inputs,
    against the float64 torch references on the device (keys: the estimator; step: attention over k_hat); ``hq``:
    query heads."""
    h, d = codec.model.num_kv_heads, codec.model.head_dim
    keys = torch.randn(batch, h, context, d, device=device, dtype=torch.bfloat16)
    values = torch.randn(batch, h, context, d, device=device, dtype=torch.bfloat16)
    key_payload, value_payload = codec.encode(StreamRequest(0, "key", tokens=keys)), codec.encode(StreamRequest(0, "value", tokens=values))
    query = torch.randn(batch, hq, 1, d, device=device, dtype=torch.bfloat16)
    sketched = codec.sketched_keys(key_payload, 0)
    scores = codec.payload_scores(query, key_payload, 0, "triton")
    reference = qjl_scores_reference(query.reshape(batch, h, hq // h, d), sketched, torch.float64)
    errors = {"qjl_scores": relative_error(scores, reference.reshape(scores.shape))}
    if fused:
        readers = [codec.payload_reader(key_payload, "key", 0)], [codec.payload_reader(value_payload, "value", 0)]
        out = decode_attention(query[:, :, 0], *readers, d**-0.5, backend="triton")
        errors["qjl_step"] = relative_error(out, decode_attention_reference(query[:, :, 0], *readers, d**-0.5, dtype=torch.float64))
    return errors


def markdown(rows: list[dict], device_name: str, setting: str) -> str:
    lines = [f"{setting} on {device_name} (error: ||kernel - reference|| / ||reference|| on fresh random inputs, "
             "the torch reference in float64 on the device):", "",
             "| batch | context | method | median ms | speed vs SDPA | bytes read per token per KV head | relative error |",
             "|---|---|---|---|---|---|---|"]
    lines += [
        f"| {r['batch']} | {r['context']} | {r['method']} | {r['ms']:.4f} | {r['vs_sdpa']:.2f}x | {r['bytes_per_token_head']:.1f} "
        f"| {r['error']:.2g} |"
        for r in rows
    ]
    return "\n".join(lines)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=at_least(1), nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--batches", type=at_least(1), nargs="+", default=[1, 4])
    parser.add_argument("--warmup", type=at_least(0), default=10)
    parser.add_argument("--reps", type=at_least(1), default=50)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny CPU run (TRITON_INTERPRET=1, two KV heads) that checks the script")
    parser.add_argument("--write", action="store_true", help="replace the QJL section of BENCHMARKS.md")
    args = parser.parse_args(argv)
    device = script_device(parser, args)
    if args.smoke:
        contexts, batches, timer, shape = [128], [1], Timer(device, 0, 1), SMOKE_SHAPE
    else:
        contexts, batches, timer, shape = args.contexts, args.batches, Timer(device, args.warmup, args.reps), LLAMA31_8B
    l2_bytes, name = l2_cache_bytes(device), device_name(device)
    info = ModelInfo("llama31_8b", 1, shape["kv_heads"], shape["head_dim"])
    sections = [
        f"Command: `{' '.join(['python -m benchmarks.bench_qjl_decode', *(argv if argv is not None else sys.argv[1:])])}` "
        f"at revision {revision()} (CUDA events, median of "
        f"{timer.reps} after {timer.warmup} warm-up calls, fresh query each call, K/V sets rotated beyond L2)."
    ]
    for setting, config in SETTINGS.items():
        codec = build_codec(config, info)
        rows = [row for batch in batches for context in contexts
                for row in bench_shape(codec, batch, context, timer, device, l2_bytes, shape)]
        sections.append(markdown(rows, name, setting))
    body = "\n\n".join(sections)
    return publish(SECTION, body, args.write and not args.smoke)


if __name__ == "__main__":
    main()
