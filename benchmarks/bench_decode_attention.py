"""Decode-step attention of the fused Triton kernels vs PyTorch SDPA on bf16 K/V, encode throughput, and
cache bytes / sequences that fit (GPU benchmark; writes its section of BENCHMARKS.md).

Llama-3.1-8B attention shapes (32 query heads, 8 KV heads, head_dim 128), one decode query per sequence.
For every codec, batch and context the cache is in the state the codec's schedule gives after
``context`` tokens (full-precision sinks and tail, encoded payload between; payload contents random, so
every code and parameter is exercised and none is zero). Timings are CUDA-event medians after a warm-up,
with a fresh random query every repetition and several independent K/V sets rotated so that together
they exceed twice the L2 cache.

- ``sdpa``: ``F.scaled_dot_product_attention`` on bf16 K/V with the ``n_rep`` query heads of each KV
  head as query rows (GQA decode without repeating K/V), the faster of the flash and memory-efficient
  backends;
- each codec: :func:`kvcomp.kernels.decode_attention.decode_attention` with ``backend="triton"``
  (split-K kernel + merge kernel over the sinks, payload and tail), without a mask; with ``--step-mask`` also with
  the one every decode step of ``generate`` passes (``kvcomp.cache.attention.decode_step_mask``: every token valid,
  one mask per step, made into one span per sequence once per step: ``ValidTokens.spans``);
- bandwidth: bytes the step must read (payload, full-precision segments, query) / time, beside the
  device's copy bandwidth (``dst.copy_(src)`` of 1 GiB: read + write bytes / time);
- encode: tokens per second compressing one layer's K and V of a 32K-token prefill, torch vs the fused
  Triton encoder (codebook codecs);
- memory: K/V cache bytes per sequence over the 32 layers (exact bit accounting) and how many sequences
  fit next to the bf16 weights (16.06 GB) in the device memory.

    python -m benchmarks.bench_decode_attention --write                  # on a CUDA GPU
    TRITON_INTERPRET=1 python -m benchmarks.bench_decode_attention --smoke   # CPU check of the script itself
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from kvcomp.codecs.codebook import CodebookCodec
from kvcomp.codecs import CodecState, ModelInfo, Payload, build_codec, expected_cache_bits, needs_calibration
from kvcomp.codecs.base import StreamRequest
from kvcomp.errors import at_least
from kvcomp.kernels.decode_attention import decode_attention, decode_attention_reference, relative_error
from kvcomp.kernels.decode_graphs import DecodeGraphs
from kvcomp.kernels.decode_plan import DecodePlans, DecodeWorkspace
from kvcomp.kernels.formats import BlockFloatReader, ScaledReader, RotaryPositions
from kvcomp.kernels.valid_tokens import ValidTokens

from benchmarks.benchmarking import (LLAMA31_8B, SMOKE_SHAPE, Timer, buffer_sets, check_smoke, device_name,
                                     l2_cache_bytes, publish, revision, script_device)

SECTION = "## Fused decode attention over compressed caches"
CODECS = {  # name -> codec config at 2 bits per value (and KIVI-4, and QJL)
    "kivi-2": {"name": "kivi", "bits": 2, "group_size": 32, "residual_length": 128},
    "kivi-4": {"name": "kivi", "bits": 4, "group_size": 32, "residual_length": 128},
    "temporalkv-2": {"name": "temporalkv", "bits": 2, "hybrid": "off"},
    "channelkv-2": {"name": "channelkv", "bits": 2},
    "kvquant-2": {"name": "kvquant", "bits": 2},
    "qjl": {"name": "qjl", "initial_layers": 0},  # the authors' general layer: 256 + 256 sign bits, 2-bit values
    "fp8": {"name": "fp8"},  # vLLM's fp8 (e4m3, one scale per tensor), read natively
    "int4-token-head": {"name": "int_token_head", "bits": 4},  # vLLM's int4: packed ints in a rotated basis
    "eden-2": {"name": "eden", "key_bits": 2, "value_bits": 2},  # Lloyd-Max codes times a norm, rotated basis
    "int8-token-head": {"name": "int_token_head", "bits": 8},  # vLLM's int8: signed bytes loaded natively
    "nvfp4": {"name": "nvfp4"},  # vLLM's NVFP4: e2m1 codes looked up, float8 scale per 16 values
    "kvarn": {"name": "kvarn"},  # K4V2 per 128-token tile, normalisers as multipliers, Hadamard basis
    # vLLM's turboquant_k3v4_nc on an encoded layer: 3-bit codes (straddling bytes), norm correction, uniform values
    "turboquant-k3v4-nc": {"name": "turboquant", "key_bits": 3, "value_bits": 4, "values": "uniform",
                           "rotation": "plain_hadamard", "density": "gaussian", "norm_correction": True},
    # EDEN-2 with center's offsets (random here): the key offset's score q . R_p c added per token in the kernel
    "eden-2-center": {"name": "eden", "key_bits": 2, "value_bits": 2, "center": "calibration"},
    # TurboQuant-prod at 3 bits: 2-bit codes plus the residual's sign sketch, scored per key and weighted in its own launches
    "turboquant-prod-3": {"name": "turboquant", "variant": "prod", "key_bits": 3, "value_bits": 3},
}
WEIGHT_BYTES = 8.03e9 * 2  # Llama-3.1-8B in bf16
ROPE_THETA = 500000.0


def synthetic_state(codec, generator) -> None:
    """Random codebooks and channel statistics for a calibrated codec, or random offsets for one with ``center``
    (speed does not depend on them)."""
    h, d = codec.model.num_kv_heads, codec.model.head_dim
    if not isinstance(codec, CodebookCodec):  # center's offsets, per layer and stream
        codec.install_state(CodecState({f"layer{layer}.{kind}.center": torch.randn(h, d, generator=generator)
                                        for layer in range(codec.model.num_layers) for kind in ("key", "value")}))
        return
    tensors = {}
    for layer in range(codec.model.num_layers):
        for kind in ("key", "value"):
            scheme = codec.scheme(kind, layer)
            groups, dim = d // scheme.layout.group_channels, scheme.layout.dim
            prefix = f"layer{layer}.{kind}"
            tensors[f"{prefix}.codebooks"] = torch.randn(h, groups, scheme.num_centroids, dim, generator=generator).bfloat16()
            tensors[f"{prefix}.scheme"] = torch.tensor([0])
            tensors[f"{prefix}.mean"] = torch.randn(h, d, generator=generator)
            tensors[f"{prefix}.std"] = torch.rand(h, d, generator=generator) + 0.5
            tensors[f"{prefix}.low"] = -3 - torch.rand(h, d, generator=generator)
            tensors[f"{prefix}.high"] = 3 + torch.rand(h, d, generator=generator)
    codec.install_state(CodecState(tensors))


def random_payload(codec, kind: str, batch: int, tokens: int, device) -> Payload:
    """A payload of ``tokens`` tokens shaped as the codec stores them, filled with random codes and
    parameters (positive scales): the layout of a real one without encoding gigabytes first."""
    block = codec.policy(kind, 0).block_size
    probe = codec.encode(StreamRequest(0, kind, tokens=torch.randn(1, codec.model.num_kv_heads, block, codec.model.head_dim, device=device)))
    reader = codec.payload_reader(probe, kind, 0)  # the stored format (inside any offset)
    float8 = {"codes"} if isinstance(reader, ScaledReader) else {"scales"} if isinstance(reader, BlockFloatReader) else set()
    tensors = {}
    for name, t in probe.tensors.items():
        shape = (batch, t.shape[1], t.shape[2] * tokens // block, *t.shape[3:])
        if t.dtype == torch.uint8:  # codes and sign bits; QJL's outlier channel ids stay channels
            high = codec.model.head_dim if name == "outlier_channels" else 256
            tensors[name] = torch.randint(0, high, shape, dtype=torch.uint8, device=device)
            if name in float8:  # float8 bit patterns with the exponent's top bit cleared: finite values, no NaN or Inf bit patterns
                tensors[name] &= 0xBF
        elif "scale" in name:
            tensors[name] = (torch.rand(shape, device=device) * 0.2 + 0.05).to(t.dtype)
        else:
            tensors[name] = torch.randn(shape, device=device).to(t.dtype)
    return Payload(tensors, tokens)


def cache_state(codec, batch: int, context: int, device):
    """Key and value segments (sinks, payload reader, tail) after ``context`` tokens, and their bytes."""
    h, d = codec.model.num_kv_heads, codec.model.head_dim
    streams, nbytes = {}, 0
    for kind in ("key", "value"):
        sinks, encoded, tail = codec.policy(kind, 0).split(context)
        segments = [torch.randn(batch, h, n, d, device=device, dtype=torch.bfloat16) for n in (sinks, tail)]
        nbytes += sum(s.numel() * s.element_size() for s in segments)
        if encoded:
            payload = random_payload(codec, kind, batch, encoded, device)
            nbytes += payload.nbytes
            segments.insert(1, codec.fused_reader(payload, kind, 0))
        streams[kind] = [s for s in segments if not isinstance(s, torch.Tensor) or s.shape[2]]
    rope = None
    if codec.pre_rope or codec.rotated_key_offset(0) is not None:  # keys rotated, or their offset
        positions = torch.arange(context, device=device, dtype=torch.int32).expand(batch, context)
        inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, d, 2, device=device).float() / d)
        rope = RotaryPositions(positions, codec.policy("key", 0).split(context)[0], inv_freq, 1.0, torch.bfloat16)
    return streams["key"], streams["value"], rope, nbytes


def sdpa_step(q, k, v):
    """GQA decode with SDPA: the query heads of each KV head as rows, no K/V repeat."""
    b, hq, d = q.shape
    h = k.shape[1]
    return F.scaled_dot_product_attention(q.view(b, h, hq // h, d), k, v).view(b, hq, d)


def fastest_sdpa(timer: Timer, inputs) -> tuple[float, str, float, float]:
    """Median ms of the faster of SDPA's flash and memory-efficient kernels (math only if neither runs), its name, its
    host ms and its device ms (:attr:`~benchmarks.benchmarking.Timer.host_ms`, ``device_ms``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    timings = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        if timings and backend == SDPBackend.MATH:
            break
        try:
            with sdpa_kernel([backend]):
                timings.append((timer(sdpa_step, inputs), backend.name.lower(), timer.host_ms, timer.device_ms))
        except RuntimeError:  # this backend cannot run these inputs on this device
            continue
    return min(timings)


def bench_decode(codecs: dict, batch: int, context: int, timer: Timer, device, l2_bytes: int,
                 graphs: tuple = (False,), shape: dict = LLAMA31_8B, masks: tuple = (False,)) -> list[dict]:
    """SDPA's row and each codec's (once per entry of ``graphs``: without, or with CUDA graphs, and of ``masks``:
    without, or with a step's mask), at the attention ``shape`` the codecs were built for."""
    h, hq, d = shape["kv_heads"], shape["query_heads"], shape["head_dim"]
    dense_bytes = 2 * batch * h * context * d * 2
    dense_sets = [
        (torch.randn(batch, h, context, d, device=device, dtype=torch.bfloat16),
         torch.randn(batch, h, context, d, device=device, dtype=torch.bfloat16))
        for _ in range(buffer_sets(dense_bytes, l2_bytes))
    ]
    turn = iter(range(10**9))

    def dense_inputs():
        k, v = dense_sets[next(turn) % len(dense_sets)]
        return torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16), k, v

    sdpa_ms, sdpa_backend, sdpa_host_ms, sdpa_device_ms = fastest_sdpa(timer, dense_inputs)
    rows = [{"batch": batch, "context": context, "method": f"sdpa bf16 ({sdpa_backend})", "ms": sdpa_ms,
             "host_ms": sdpa_host_ms, "device_ms": sdpa_device_ms, "vs_sdpa": 1.0,
             "bytes": dense_bytes, "error": 0.0}]
    dense_sets.clear()  # free the bf16 sets before the payloads are built
    for name, codec in codecs.items():
        for captured, masked in ((c, m) for c in graphs for m in masks):
            try:
                row = _bench_codec(name, codec, batch, context, timer, device, l2_bytes, turn, captured, hq, masked)
            except Exception as failure:  # one format that fails on this device must not cost the others' rows
                row = {"batch": batch, "context": context, "method": name, "failed": f"{type(failure).__name__}: {failure}"}
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if "ms" in row:
                row["vs_sdpa"] = sdpa_ms / row["ms"]
            print(f"[bench] {batch} x {context} {row['method']}: " + (f"{row['ms']:.4f} ms ({row['device_ms']:.4f} on the "
                  f"device), error {row['error']:.2g}"
                  if "ms" in row else f"failed ({row['failed']})"), flush=True)
            rows.append(row)
    return rows


def _bench_codec(name: str, codec, batch: int, context: int, timer: Timer, device, l2_bytes: int, turn,
                 graphs: bool, hq: int, masked: bool = False) -> dict:
    """One codec's row: median ms of the fused step over rotated caches, and its error on a fresh one. ``graphs``: the
    calls captured in CUDA graphs (:mod:`kvcomp.kernels.decode_graphs`; each rotated cache is captured once); ``hq``:
    query heads; ``masked``: each call given the step's mask (every token valid), as ``generate``'s steps are."""
    d = codec.model.head_dim
    first = cache_state(codec, batch, context, device)
    states = [first] + [cache_state(codec, batch, context, device) for _ in range(buffer_sets(first[3], l2_bytes) - 1)]

    def inputs():
        keys, values, rope, _ = states[next(turn) % len(states)]
        return torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16), keys, values, rope

    # a model's layers share their step's plan and workspace: each call is one such layer
    planned = DecodePlans(DecodeWorkspace(DecodeGraphs() if graphs else None))

    valid = ValidTokens(torch.ones(batch, context, dtype=torch.bool, device=device)) if masked else None

    def step(q, keys, values, rope):
        return decode_attention(q, keys, values, d**-0.5, valid, rope, "triton", step=planned)

    if graphs:  # each rotated cache met twice before the timing (run, then captured): the timed calls are replays
        for _ in range(2):
            for keys, values, rope, _ in states:
                step(torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16), keys, values, rope)
    ms = timer(step, inputs)
    host_ms, device_ms = timer.host_ms, timer.device_ms
    states.clear()
    error = float("nan")
    if context <= 32768:  # a fresh random cache and query against the float64 reference on the device
        keys, values, rope, _ = cache_state(codec, batch, context, device)
        q = torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16)
        reference = decode_attention_reference(q, keys, values, d**-0.5, None, rope, torch.float64)
        error = relative_error(step(q, keys, values, rope), reference)
        del keys, values, reference
    return {"batch": batch, "context": context, "method": name + (" (mask)" if masked else "")
            + (" (CUDA graphs)" if graphs else ""), "ms": ms,
            "host_ms": host_ms, "device_ms": device_ms, "bytes": first[3], "error": error}


def copy_bandwidth(timer: Timer, device) -> float:
    """Device copy bandwidth in GB/s (bytes read + written per second)."""
    n = (1 << 30) if device.type == "cuda" else (1 << 20)
    src, dst = torch.empty(n, dtype=torch.uint8, device=device).random_(), torch.empty(n, dtype=torch.uint8, device=device)
    ms = timer(lambda: dst.copy_(src), lambda: ())
    return 2 * n / ms / 1e6


def bench_encode(codecs: dict, tokens: int, timer: Timer, device) -> list[dict]:
    """Tokens/s encoding one layer's K and V (batch 1) with the torch path and, where it exists, the Triton encoder;
    ``tokens`` rounded down to whole blocks of the codec (at least one)."""
    rows = []
    for name, codec in codecs.items():
        block = max(codec.policy(kind, 0).block_size for kind in ("key", "value"))
        n = max(block, tokens // block * block)
        h, d = codec.model.num_kv_heads, codec.model.head_dim
        x = {kind: torch.randn(1, h, n, d, device=device, dtype=torch.bfloat16) for kind in ("key", "value")}

        def encode(backend):
            for kind in ("key", "value"):
                codec.encode(StreamRequest(0, kind, tokens=x[kind], kernel_backend=backend))

        row = {"method": name, "fused": isinstance(codec, CodebookCodec)}
        for backend in ("torch", "triton") if row["fused"] else ("torch",):
            row[backend] = n / timer(lambda: encode(backend), lambda: ()) * 1e3
        rows.append(row)
    return rows


def memory_rows(configs: dict, context: int, memory_bytes: float) -> list[dict]:
    """Cache bytes per sequence (32 layers, exact accounting; codebooks counted once) and sequences that fit."""
    info = ModelInfo("llama31_8b", 32, LLAMA31_8B["kv_heads"], LLAMA31_8B["head_dim"])
    rows = []
    for name, config in {"bf16": {"name": "fp16"}, **configs}.items():
        codec = build_codec(config, info)
        per_sequence = expected_cache_bits(codec, context, 1, 16) / 8
        tables = 0
        if isinstance(codec, CodebookCodec):
            for layer in range(info.num_layers):
                for kind in ("key", "value"):
                    scheme = codec.scheme(kind, layer)
                    tables += info.num_kv_heads * (info.head_dim // scheme.layout.group_channels) * scheme.num_centroids * scheme.layout.dim * 2
        free = memory_bytes - WEIGHT_BYTES - tables
        rows.append({"method": name, "gib_per_sequence": per_sequence / 2**30, "tables_mib": tables / 2**20,
                     "sequences": int(free // per_sequence)})
    return rows


def tables(decode_rows, copy_gbps, encode_rows, mem_rows, context_mem, name, memory_gb, timer, command) -> str:
    out = [
        f"Device: {name}; measured copy bandwidth {copy_gbps:.0f} GB/s. Command: `{command}` at revision {revision()} "
        f"(CUDA events, median of {timer.reps} after {timer.warmup} warm-up calls, fresh query each call, "
        "inputs rotated beyond twice the L2 cache).",
        "",
        "Decode-step attention (one layer, Llama-3.1-8B heads; error: ||kernel - reference|| / ||reference|| on fresh "
        "random inputs, the torch reference in float64 on the device, the kernel's output in bf16; up to 32K tokens):",
        "",
        "| batch | context | method | median ms | host ms | device ms | speed vs SDPA | MB read | GB/s | "
        "% of copy bandwidth | relative error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in decode_rows:
        if "failed" in r:
            out.append(f"| {r['batch']} | {r['context']} | {r['method']} | failed: {r['failed'][:200]} | | | | | | | |")
            continue
        gbps = r["bytes"] / r["ms"] / 1e6
        out.append(f"| {r['batch']} | {r['context']} | {r['method']} | {r['ms']:.4f} | {r['host_ms']:.4f} | "
                   f"{r['device_ms']:.4f} | {r['vs_sdpa']:.2f}x | "
                   f"{r['bytes'] / 1e6:.1f} | {gbps:.0f} | {100 * gbps / copy_gbps:.0f}% | {r['error']:.2g} |")
    out += ["", "Prefill encode throughput (one layer's K and V, batch 1, tokens/s):", "",
            "| codec | torch | Triton encoder |", "|---|---|---|"]
    for r in encode_rows:
        fused = f"{r['triton']:.3g}" if r["fused"] else "(torch path)"
        out.append(f"| {r['method']} | {r['torch']:.3g} | {fused} |")
    out += ["", f"K/V cache per sequence at {context_mem} tokens (32 layers) and sequences that fit in {memory_gb:.0f} GB "
            "beside the bf16 weights:", "", "| codec | GiB per sequence | codebooks MiB | sequences |", "|---|---|---|---|"]
    out += [f"| {r['method']} | {r['gib_per_sequence']:.3f} | {r['tables_mib']:.1f} | {r['sequences']} |" for r in mem_rows]
    return "\n".join(out)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=at_least(1), nargs="+", default=[4096, 8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--batches", type=at_least(1), nargs="+", default=[1, 16])
    parser.add_argument("--codecs", nargs="+", default=list(CODECS), choices=list(CODECS))
    parser.add_argument("--encode-tokens", type=at_least(1), default=32768)
    parser.add_argument("--warmup", type=at_least(0), default=10)
    parser.add_argument("--reps", type=at_least(1), default=50)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny CPU run (TRITON_INTERPRET=1, two KV heads) checking the script (a failed row fails it)")
    parser.add_argument("--cuda-graphs", action="store_true", help="also time each codec's call captured in CUDA graphs")
    parser.add_argument("--step-mask", action="store_true",
                        help="also time each codec's call with the mask generate passes at every decode step")
    parser.add_argument("--write", action="store_true", help="replace this benchmark's section of BENCHMARKS.md")
    args = parser.parse_args(argv)
    device = script_device(parser, args)
    shape = LLAMA31_8B
    if args.smoke:
        contexts, batches, encode_tokens, timer = [160], [1], 32, Timer(device, 0, 1)
        memory_gb, shape = 80.0, SMOKE_SHAPE
    else:
        contexts, batches, encode_tokens = args.contexts, args.batches, args.encode_tokens
        timer = Timer(device, args.warmup, args.reps)
        memory_gb = torch.cuda.get_device_properties(device).total_memory / 1e9
    generator = torch.Generator().manual_seed(0)
    info = ModelInfo("llama31_8b", 1, shape["kv_heads"], shape["head_dim"])
    codecs = {}
    for name in args.codecs:
        codec = build_codec(CODECS[name], info)
        if needs_calibration(codec):
            synthetic_state(codec, generator)
        codecs[name] = codec
    throughput = Timer(device, timer.warmup, timer.reps, device_time=False)  # a copy's and the encoders' throughput
    copy_gbps = copy_bandwidth(throughput, device)
    decode_rows = []
    for batch in batches:
        for context in contexts:
            decode_rows += bench_decode(codecs, batch, context, timer, device, l2_cache_bytes(device),
                                        (False, True) if args.cuda_graphs else (False,), shape,
                                        (False, True) if args.step_mask else (False,))
            print(f"[bench] batch {batch} context {context} done", flush=True)
    encode_rows = bench_encode(codecs, encode_tokens, throughput, device)
    context_mem = max(contexts)
    mem_rows = memory_rows({name: CODECS[name] for name in args.codecs}, context_mem, memory_gb * 1e9)
    command = " ".join(["python -m benchmarks.bench_decode_attention", *(argv if argv is not None else sys.argv[1:])])
    body = tables(decode_rows, copy_gbps, encode_rows, mem_rows, context_mem, device_name(device), memory_gb, timer, command)
    published = publish(SECTION, body, args.write and not args.smoke)
    check_smoke(args.smoke, [f"{r['method']}: {r['failed']}" for r in decode_rows if "failed" in r])
    return published


if __name__ == "__main__":
    main()
