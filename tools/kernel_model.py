"""Predicted decode-step times on an H100 from the SASS of the decode kernels (static model, no GPU):
the current kernels, and the kernels of an earlier commit (``--commit``) beside the H100 times measured for them
(:data:`MEASURED`, :data:`QJL_MEASURED`).

Each launch is compiled once for sm_90a at a small cache (batch 1, 2,048 tokens; a launch's code does not
depend on the cache length) with :mod:`tools.resources`, its tile loop counted and the time of
each shape predicted by :mod:`tools.static_model` from the launch geometry of that shape. A step
is its split launches plus the merge (the merge's loop over slices counted the same way). The earlier
commit's kernels are read with ``git show`` from ``--repo`` and launched through a recorder (their host code is
run on CPU tensors; its kernels are compiled, never run).

    PYTHONPATH="$T36" python -m tools.kernel_model          # Triton 3.6, as on the GPU machine (see
                                                              # tools/kernel_resources.py for $T36)
    python -m tools.kernel_model --codecs kivi-2 --no-old   # the current KIVI-2 only
    PYTHONPATH="$T36" python -m tools.kernel_model --no-old --operands float32   # with TF32 tl.dot operands
    PYTHONPATH="$T36" python -m tools.kernel_model --sweep BENCHMARKS.md   # every measured launch configuration
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import math
import os
import subprocess
import tempfile
from pathlib import Path
from unittest import mock

import torch

from kvcomp.codecs import ModelInfo, build_codec, needs_calibration
from kvcomp.codecs.base import StreamRequest
from kvcomp.kernels import Launch
from kvcomp.kernels import decode_attention_triton as today
from kvcomp.kernels.decode_graphs import DecodeGraphs
from kvcomp.kernels.decode_plan import DecodePlans, DecodeWorkspace, plan_decode
from kvcomp.kernels.qjl_scores_triton import qjl_score_launch
from kvcomp.kernels.decode_attention import decode_attention
from kvcomp.kernels.valid_tokens import ValidTokens

from benchmarks.bench_decode_attention import CODECS, cache_state, synthetic_state
from benchmarks.sweep_decode_kernel import CONFIGS as SWEEP_CONFIGS
from benchmarks.sweep_decode_kernel import SECTION as SWEEP_SECTION
from tools.resources import compile_launch, kernel_resources, static_target
from tools.static_model import (
    HOST_FACTOR, L1_BYTES, LOCAL, SMS, Geometry, accesses, bounds, count, disassemble, host_seconds, load_cycles,
    local_cycles, parse_sass, record_global_accesses, step_seconds, tile_instructions)

H, D, R, SMALL = 8, 128, 4, 2048  # Llama-3.1-8B: 8 KV heads, head_dim 128, 4 query heads per KV head
SHAPES = [(1, 4096), (1, 32768), (16, 4096), (16, 32768), (16, 131072)]
OLD_SHAPES = [(1, 4096), (1, 32768), (1, 131072), (16, 4096), (16, 32768), (16, 131072)]
MEASURED = {  # ms of the --commit kernels on an H100 (benchmarks/bench_decode_attention.py), in OLD_SHAPES' order
    name: dict(zip(OLD_SHAPES, times)) for name, times in {
        "kivi-2": (0.4439, 0.6958, 2.2242, 1.6259, 10.0309, 38.5568),
        "kivi-4": (0.3398, 0.8104, 2.6744, 1.6640, 9.8794, 37.6079),
        "temporalkv-2": (0.3929, 0.7766, 1.8981, 1.2026, 7.2743, 27.6766),
        "channelkv-2": (0.6174, 0.7830, 2.1721, 1.0363, 5.7778, 25.0333),
        "kvquant-2": (0.3930, 0.8385, 1.9097, 1.1713, 6.9190, 26.4142),
    }.items()
}
QJL_MEASURED = {(1, 8192): 0.3391, (1, 32768): 0.9060, (1, 65536): 1.6459, (4, 8192): 0.8973, (4, 32768): 3.0805,
                (4, 65536): 5.9251}  # the same H100 (benchmarks/bench_qjl_decode.py), authors' general layer, scores only
QJL_LAYER = 31  # a general layer: the authors' 256 + 256 sign bits
# The current kernels' times measured on an H200 (MEASURED_TODAY_AT): KIVI's and QJL's from BENCHMARKS.md's "Fused
# decode attention" and "QJL decode-step scores" tables, the codebook kernels with their register cap from a launch
# sweep at two shapes. A row is compared only with a launch whose machine code is the one measured: the
# SASS fingerprint (:func:`sass_fingerprint`) of its split launch (QJL's scores: its score launch) compiled by Triton
# 3.6, the GPU machine's, without a mask as the benchmark called it (:func:`today_step`)
MEASURED_TODAY_AT, MEASURED_TODAY_CARD = "323c1c0 (KIVI, QJL) and c2b5460 (codebooks)", "H200"
MEASURED_TODAY_SASS = {"kivi-2": "02ea37e3c545", "kivi-4": "2872d7cfe786", "temporalkv-2": "13f9dd521957",
                       "channelkv-2": "1261dbec5b38", "kvquant-2": "13d1f9ee9da3", "qjl step": "c44995975ca0",
                       "qjl scores": "1bc20fe8cb29"}
MEASURED_TODAY = {  # ms
    "kivi-2": dict(zip(SHAPES, (0.5392, 0.6624, 0.6341, 1.3410, 3.7411))),
    "kivi-4": dict(zip(SHAPES, (0.4967, 0.6621, 0.6586, 1.4214, 4.0984))),
    "temporalkv-2": {(1, 32768): 0.6260, (16, 32768): 2.1630},
    "channelkv-2": {(1, 32768): 0.6187, (16, 32768): 2.2482},
    "kvquant-2": {(1, 32768): 0.6477, (16, 32768): 2.0069},
    "qjl step": dict(zip(SHAPES, (0.5310, 1.0207, 1.2547, 3.8061, 14.1240))),
}
QJL_MEASURED_TODAY = {(1, 8192): 0.5640, (1, 32768): 0.3747, (4, 8192): 0.6447, (4, 32768): 0.8693}
# device ms of the same launches (each call queued behind a spacer that hides its host work: Timer.device_ms)
MEASURED_TODAY_DEVICE = {
    **{("kivi-2", shape): ms for shape, ms in zip(SHAPES, (0.0289, 0.1018, 0.1352, 0.8286, 3.1896))},
    **{("kivi-4", shape): ms for shape, ms in zip(SHAPES, (0.0294, 0.1134, 0.1505, 0.9203, 3.5345))},
    **{("qjl step", shape): ms for shape, ms in zip(SHAPES, (0.0647, 0.2425, 0.4675, 3.2794, 12.9094))},
    ("temporalkv-2", (1, 32768)): 0.2091, ("temporalkv-2", (16, 32768)): 1.8696,
    ("channelkv-2", (1, 32768)): 0.1956, ("channelkv-2", (16, 32768)): 1.8660,
    ("kvquant-2", (1, 32768)): 0.1851, ("kvquant-2", (16, 32768)): 1.6747,
}


def codec_for(name: str):
    """``name``'s codec (calibrated on synthetic data), with torch's generator reset: the random payload drawn next is
    the same every run (its codes decide which codebook lines a tile gathers, hence the loads' reuse)."""
    torch.manual_seed(0)
    codec = build_codec(CODECS[name], ModelInfo("llama31_8b", 1, H, D))
    if needs_calibration(codec):
        synthetic_state(codec, torch.Generator().manual_seed(0))
    return codec


def analysed(launch: Launch, skip: tuple = (), whole: Launch | None = None) -> dict:
    """Resources and tile counts of one compiled launch; ``whole``: the same launch in one slice per head, whose
    program 0 runs every tile of its head (the loads' reuse between tiles, :func:`load_cycles`)."""
    compiled = compile_launch(launch)
    found = kernel_resources(compiled)
    sass = disassemble(compiled.asm["cubin"])
    instructions, looped = tile_instructions(sass, skip)
    found["sass"] = sass_fingerprint(sass)
    resident = round(found["occupancy"] * 64) // found["num_warps"]
    l1_bytes = (L1_BYTES - resident * found["shared"]) / max(1, resident)  # each resident program's share of the L1
    recorded = record_global_accesses(whole or launch)
    loads = {**load_cycles(recorded, l1_bytes), LOCAL: local_cycles(found["stack"], 32 * found["num_warps"], l1_bytes)}
    found.update(counts=count(instructions, accesses(launch, compiled, recorded), loads), looped=looped, resident=resident)
    return found


def stream_bounds(codec, context: int):
    """Segment bounds and encoded flags of keys and values after ``context`` tokens (sinks, payload, tail)."""
    out = []
    for kind in ("key", "value"):
        lengths = codec.policy(kind, 0).split(context)
        bounds, encoded = [0], []
        for i, n in enumerate(lengths):
            if n:
                bounds.append(bounds[-1] + n)
                encoded.append(i == 1)
        out += [tuple(bounds), tuple(encoded)]
    return out


def step_time(parts: list[tuple[dict, Geometry]], host: float) -> tuple[float, str]:
    """A step's predicted seconds (:func:`~tools.static_model.step_seconds`) and its largest part: ``host``
    (this CPU's ``host`` seconds on the GPU machine's), or the largest term of its first launch."""
    found = [bounds(a["counts"], g) for a, g in parts]
    seconds = step_seconds(found, host)
    device = sum(f["time"] for f in found)
    return seconds, "host" if seconds - device > device else max((v, k) for k, v in found[0].items() if k != "time")[1]


def bound_launches(kernels: tuple) -> contextlib.AbstractContextManager:
    """A context in which launches are bound by Triton instead of run: ``Launch()`` and ``Recorder`` calls go
    through ``warmup`` (argument binding, kernel lookup, compiling on a miss) for a static sm_90 target: what a
    call does on the host before the driver launches."""
    stack = contextlib.ExitStack()
    stack.enter_context(static_target(90))
    stack.enter_context(mock.patch.object(Launch, "__call__", lambda self: self.kernel.warmup(grid=self.grid, **self.args)))
    for recorder in kernels:
        stack.enter_context(mock.patch.object(recorder, "bind", True))
    return stack


def today_step(name: str, shapes, options: dict | None = None, mask: bool = False) -> dict:
    """Predicted ms per shape of the current split + merge launches of ``name`` (``options`` of
    :func:`~kvcomp.kernels.decode_attention_triton.decode_launches`: a launch configuration), called as
    ``bench_decode_attention.py`` calls them: without a mask, or (``mask``) with the step's mask of ``generate``, every
    token valid (``--step-mask``: one exact span per sequence, so the tile's mask read does not run)."""
    options = options or {}
    codec = codec_for(name)
    keys, values, rope, nbytes = cache_state(codec, 1, SMALL, torch.device("cpu"))
    query = torch.randn(1, H * R, D, dtype=torch.bfloat16)
    valid = ValidTokens(torch.ones(1, SMALL, dtype=torch.bool)) if mask else None
    model_query, model_keys, model_values, model_rope = query, keys, values, rope
    # a rotated or offset payload's own launches (the query's rotation is a matmul outside them; these caches have no
    # sinks or tail beside such a payload)
    query, keys, values, valid, rope, options = today.payload_launch_inputs(query, keys, values, valid, rope, options)
    variants = {}
    payloads = [s for s in (*keys, *values) if not isinstance(s, torch.Tensor)]
    probe = today.decode_launches(query, keys, values, D**-0.5, valid, rope, **options)[1][0].args  # tile and path

    def launched(per_multiprocessor: int) -> tuple[list, list[dict], dict]:
        """The launches compiled as the launcher shapes them for a grid that gives the busiest multiprocessor
        ``per_multiprocessor`` programs (their warps and register cap: ``decode_attention_triton._launch_shape``), the
        split launches and the merge analysed."""
        shape = today._launch_shape(payloads, probe["BLOCK_T"], per_multiprocessor, options.get("num_warps"),
                                    options.get("registers"), probe["DOT"])
        # the small cache planned over one multiprocessor where the grid crowds them (or a cap is asked for), else over
        # one per program: the merge's slots, whose loads' reuse is recorded, as the model has always compiled them
        crowded = today._crowded(per_multiprocessor, today.WARPS) or "registers" in options
        key = (*shape, crowded)
        if key not in variants:
            shaped = {**options, "num_warps": shape[0], "registers": shape[1]}
            with mock.patch.object(today, "_multiprocessors", lambda device: 1 if crowded else 1 << 20):
                _, launches = today.decode_launches(query, keys, values, D**-0.5, valid, rope, **shaped)
                _, wholes = today.decode_launches(query, keys, values, D**-0.5, valid, rope, **{**shaped, "num_splits": 1})
            found = [analysed(launch, ("_dense", "_dense_pick", "_dense_fields", "_masked"), whole)
                     for launch, whole in zip(launches[:-1], wholes)]
            variants[key] = launches, found, analysed(launches[-1])
        return variants[key]

    step = DecodePlans()  # one layer's call in a step whose plan and workspace are made (as the benchmark times it)
    with bound_launches(()):  # the benchmark's call, on this CPU: its launcher and Triton's binding of each launch
        host = host_seconds(lambda: decode_attention(model_query, model_keys, model_values, D**-0.5, None, model_rope,
                                                     "triton", step=step) if not options else
                            today.decode_attention_triton(model_query, model_keys, model_values, D**-0.5, None,
                                                          key_rope=model_rope, step=step, **options))
    graphed = graphed_host_seconds(model_query, model_keys, model_values, model_rope) if not options else None
    block = probe["unit"]  # the tokens per tile the launch was planned with
    out, sass = {}, {}
    for batch, context in shapes:
        plan = plan_decode(*stream_bounds(codec, context), batch * H, SMS, block, None)
        launches, found, merged = launched(-(-batch * H * plan.launches[0].splits // SMS))
        splits = launches[:-1]
        if len(plan.launches) != len(splits):
            raise RuntimeError(f"{name}: {len(plan.launches)} launches at {context} tokens, {len(splits)} compiled at {SMALL}")
        parts = []
        for planned, launch, a in zip(plan.launches, splits, found):
            per_program = math.ceil(math.ceil(planned.tiles / planned.splits) * block / launch.args["BLOCK_T"])
            parts.append((a, Geometry(batch * H * planned.splits, a["num_warps"], a["resident"], per_program,
                                      nbytes * batch * (planned.hi - planned.lo) / SMALL)))
        parts.append((merged, Geometry(batch * H, merged["num_warps"], merged["resident"], plan.slots, 0.0)))
        out[(batch, context)] = step_time(parts, host)
        sass[(batch, context)] = found[0]["sass"]
    return {"shapes": out, "sass": sass, "launches": found + [merged], "host": host, "graphed": graphed}


def graphed_host_seconds(query, keys, values, rope) -> float | None:
    """Host seconds of a layer's call under CUDA graphs that is replayed by its inputs (:mod:`kvcomp.kernels.decode_graphs`):
    the call's setup, the lookup and the query's copy into the graph, in a step whose plan and bounds exist, without the
    graph's replay (a stand-in that does nothing: there is no GPU here); a rotated payload's call replays its launch
    groups' split launches and runs their rotations and its merge as they are. ``None`` where no launch of the call is
    replayed by its inputs (launches that read what the call made)."""
    workspace = DecodeWorkspace(DecodeGraphs(capture=lambda run: lambda: None))
    step = DecodePlans(workspace)
    with mock.patch.object(Launch, "__call__", lambda self: None):
        call = lambda: decode_attention(query, keys, values, D**-0.5, None, rope, "triton", step=step)  # noqa: E731
        call(), call()  # met, then captured: found by its inputs after
        return host_seconds(call) if workspace.graphs.by_inputs else None


def old_module(repo: Path, commit: str, path: str):
    """``path`` of ``commit`` as a module of its own (its imports of moved classes pointed at the current modules)."""
    source = subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{path}"], capture_output=True, text=True,
                            check=True).stdout
    for moved in ("kvcomp.kernels.decode_attention", "kvcomp.kernels.qjl_scores"):
        source = source.replace(f"from {moved} import", "from kvcomp.kernels.formats import")
    name = f"kvcomp_{commit}_{Path(path).stem}"
    file = Path(tempfile.mkdtemp()) / f"{name}.py"  # kept: line info of the compiled kernels points here
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Recorder:
    """Stands in for a jitted kernel: ``kernel[grid](*args, **kwargs)`` appends a :class:`Launch` to ``out`` or, where
    ``bind`` (:func:`bound_launches`), has Triton bind it."""

    bind = False

    def __init__(self, kernel, out: list):
        self.kernel, self.out = kernel.kernel if isinstance(kernel, Recorder) else kernel, out

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            if self.bind:
                self.kernel.warmup(*args, grid=grid, **kwargs)
            else:
                self.out.append(Launch(self.kernel, grid, {**dict(zip(self.kernel.arg_names, args)), **kwargs}))
        return record


def old_step(module, name: str, shapes) -> dict:
    """Predicted ms per shape of the earlier commit's split + merge launches of ``name`` (one split launch per interval
    between the segment bounds of either stream, its slices as that commit cut them)."""
    codec = codec_for(name)
    keys, values, rope, nbytes = cache_state(codec, 1, SMALL, torch.device("cpu"))
    launches = []
    module._split_kernel, module._merge_kernel = Recorder(module._split_kernel, launches), Recorder(module._merge_kernel, launches)
    module._multiprocessors = lambda device: SMS
    query = torch.randn(1, H * R, D, dtype=torch.bfloat16)
    starts, lengths = torch.zeros(1, dtype=torch.int32), torch.full((1,), SMALL, dtype=torch.int32)
    module.decode_attention_triton(query, keys, values, D**-0.5, starts, lengths, rope)
    with bound_launches((Recorder,)):
        host = host_seconds(lambda: module.decode_attention_triton(query, keys, values, D**-0.5, starts, lengths, rope))
    splits, merge = launches[:-1], launches[-1]
    del launches[:]
    module.decode_attention_triton(query, keys, values, D**-0.5, starts, lengths, rope, num_splits=1)
    found, merged = [analysed(launch, (), whole) for launch, whole in zip(splits, launches)], analysed(merge)
    out = {}
    for batch, context in shapes:
        key_bounds, _, value_bounds, _ = stream_bounds(codec, context)
        cuts = sorted(set(key_bounds) | set(value_bounds))
        if len(cuts) - 1 != len(splits):
            raise RuntimeError(f"{name}: {len(cuts) - 1} intervals at {context} tokens, {len(splits)} compiled at {SMALL}")
        parts, slots = [], 0
        for lo, hi, launch, a in zip(cuts, cuts[1:], splits, found):
            block = launch.args["BLOCK_T"]
            tiles = -(-(hi - lo) // block)
            n = min(tiles, max(1, -(-2 * SMS // (batch * H))))
            chunk = -(-tiles // n)
            n = -(-tiles // chunk)
            parts.append((a, Geometry(batch * H * n, a["num_warps"], a["resident"], chunk, nbytes * batch * (hi - lo) / SMALL)))
            slots += n
        parts.append((merged, Geometry(batch * H, merged["num_warps"], merged["resident"], slots, 0.0)))
        out[(batch, context)] = step_time(parts, host)
    return {"shapes": out, "launches": found + [merged], "host": host}


def qjl_scores(module, shapes) -> dict:
    """Predicted ms per shape of the QJL score kernel (``module``: the earlier commit's, or ``None`` for the current one)."""
    torch.manual_seed(0)  # the same random keys every run
    codec = build_codec({"name": "qjl"}, ModelInfo("llama31_8b", 32, H, D))
    payload = codec.encode(StreamRequest(QJL_LAYER, "key", tokens=torch.randn(1, H, SMALL, D)))
    keys = codec.sketched_keys(payload, QJL_LAYER)
    query = torch.randn(1, H, R, D)
    if module is None:
        _, launch = qjl_score_launch(query, keys)
        with bound_launches(()):
            host = host_seconds(lambda: qjl_score_launch(query, keys)[1]())
    else:
        launches = []
        module._qjl_scores_kernel = Recorder(module._qjl_scores_kernel, launches)
        module.qjl_scores_triton(query, keys)
        launch = launches[0]
        with bound_launches((Recorder,)):
            host = host_seconds(lambda: module.qjl_scores_triton(query, keys))
    a = analysed(launch)
    per_token = keys.signs[0, 0, 0].numel() + keys.outlier_signs[0, 0, 0].numel() + 4  # sign bytes + two fp16 norms
    group = keys.group_size
    out = {}
    for batch, context in shapes:
        geometry = Geometry(batch * H * (context // group) * launch.grid[2], a["num_warps"], a["resident"], 1,
                            batch * H * context * per_token)
        out[(batch, context)] = step_time([(a, geometry)], host)
    return {"shapes": out, "launches": [a], "host": host}


def sass_fingerprint(sass: str) -> str:
    """A short hash of a kernel's machine code (every instruction's opcode and operands, not its addresses or source
    lines): equal where two compilations run the same code."""
    instructions, _ = parse_sass(sass)
    return hashlib.sha1(repr([(i.opcode, i.operands) for i in instructions]).encode()).hexdigest()[:12]


def ranking_line(shape: tuple, predicted: dict, measured: dict) -> str:
    """One shape's predicted and measured order of the kernels (fastest first) and how many separated pairs agree."""
    agree, pairs = separated_pairs(predicted, measured)
    return (f"- {shape[0]} x {shape[1] // 1024}K: predicted {', '.join(sorted(predicted, key=predicted.get))}; measured "
            f"{', '.join(sorted(measured, key=measured.get))}: "
            f"{'same order' if spearman_agrees(predicted, measured) else 'DIFFERENT order'}; {agree} of the "
            f"{pairs} pairs measured {100 * APART:.0f} % or more apart ordered as measured")


def spearman_agrees(predicted: dict, measured: dict) -> bool:
    """Whether the predicted times order the kernels as the measured ones (ties in neither)."""
    return sorted(predicted, key=predicted.get) == sorted(measured, key=measured.get)


APART = 0.05  # run-to-run spread of one kernel's time on the H100 (KIVI-2 at 16 x 32K:
# 2.933 and 2.819 ms, KVarN 4.367, 4.022 and 4.053 in three runs of one revision)


def separated_pairs(predicted: dict, measured: dict) -> tuple[int, int]:
    """``(ordered as measured, pairs)`` over the pairs of kernels whose measured times lie ``APART`` or more apart
    (closer pairs are within the benchmark's run-to-run spread: KIVI-2 and KIVI-4 swap places between shapes)."""
    names = list(measured)
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
             if abs(measured[a] - measured[b]) >= APART * min(measured[a], measured[b])]
    return sum((predicted[a] - predicted[b]) * (measured[a] - measured[b]) > 0 for a, b in pairs), len(pairs)


def measured_sweep(path: Path) -> dict:
    """``{(card, run, codec, batch, context): {configuration: ms}}`` from the launch-configuration section of
    BENCHMARKS.md (``python -m benchmarks.sweep_decode_kernel --write`` on a GPU; the card: the last H100 or H200 named above
    the row; the run: how many commands of the sweep script were named above it)."""
    text = path.read_text()
    start = text.find(SWEEP_SECTION)
    if start < 0:
        raise SystemExit(f"{path} has no section {SWEEP_SECTION!r}: run python -m benchmarks.sweep_decode_kernel --write on a GPU first")
    end = text.find("\n## ", start + len(SWEEP_SECTION))
    out, card, run = {}, None, 0
    for line in text[start : end if end >= 0 else len(text)].splitlines():
        if not line.startswith("|"):
            named = [c for c in ("H100", "H200") if c in line]
            card = named[-1] if named else card
            run += "sweep_decode_kernel" in line
            continue
        cells = [c.strip() for c in line.strip(" |").split(" | ")]
        if len(cells) in (9, 10) and cells[1][:1].isdigit() and not cells[3].startswith("failed"):  # 10: with device ms
            batch, context = (int(x) for x in cells[1].split(" x "))
            out.setdefault((card, run, cells[0], batch, context), {})[cells[2]] = float(cells[3])
    return out


def concordance(predicted: dict, measured: dict) -> float:
    """Fraction of the pairs of configurations that the predicted times order as the measured ones."""
    names = list(measured)
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
    agree = sum((predicted[a] - predicted[b]) * (measured[a] - measured[b]) > 0 for a, b in pairs)
    return agree / len(pairs)


# The default row of the first H200 sweep, before the defaults changed: the register path with
# 16 warps and 16-token tiles (8 for codebook payloads and QJL's sketched keys)
FORMER_DEFAULT = "default (register path, 16 warps, 16-token tiles)"


# The default row of the H100 sweeps, before default_tile: 4 warps and 32-token tiles for every format (QJL's
# sketched keys then took the register path; the model predicts their current tl.dot path)
FORMER_TILE_DEFAULT = "default (32-token tiles)"


def sweep_options(label: str, name: str) -> dict:
    if label == FORMER_DEFAULT:
        return dict(dot=False, num_warps=16, block_tokens=16 if name.startswith("kivi") else 8)
    if label == FORMER_TILE_DEFAULT:
        return dict(num_warps=4, block_tokens=32)
    return SWEEP_CONFIGS[label]


def sweep_check(path: Path) -> list[str]:
    """The model's prediction of every measured launch configuration (``benchmarks/sweep_decode_kernel.py``)."""
    measured = measured_sweep(path)
    lines = [f"Launch configurations measured by `benchmarks/sweep_decode_kernel.py` ({path.name}) against the model (an "
             "H100's figures; these kernels are not DRAM-bound, and both cards have 132 SMs at up to 1.98 GHz):",
             "", "| card | codec | batch x context | configuration | predicted ms | bound | measured ms | ratio |",
             "|---|---|---|---|---:|---|---:|---:|"]
    summary = []
    for (card, _, name, batch, context), times in measured.items():
        predicted = {}
        for label, ms in times.items():
            seconds, bound = today_step(name, [(batch, context)], sweep_options(label, name))["shapes"][(batch, context)]
            predicted[label] = seconds * 1e3
            lines.append(f"| {card} | {name} | {batch} x {context // 1024}K | {label} | {predicted[label]:.3f} | {bound} | "
                         f"{ms:.3f} | {predicted[label] / ms:.2f} |")
        ratios = [predicted[k] / times[k] for k in times]
        best = min(times, key=times.get)
        summary.append(f"- {card} {name} at {batch} x {context // 1024}K: ratio {min(ratios):.2f}-{max(ratios):.2f}; "
                       f"{100 * concordance(predicted, times):.0f} % of configuration pairs ordered as measured; "
                       f"fastest measured: {best}, predicted: {min(predicted, key=predicted.get)}")
    return lines + [""] + summary


def tile_table(rows: list[tuple[str, dict]]) -> list[str]:
    out = ["| kernel | launch | warps | registers | shared (B) | resident programs / SM | instructions / tile / warp | "
           "global loads (by bytes per lane) | shared ld / st | fma / alu | shuffles | conversions | MUFU | BAR.SYNC | "
           "L1 wavefronts (lanes' addresses) |", "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, a in rows:
        c = a["counts"]
        widths = ", ".join(f"{n}x{w}B" for w, n in sorted(c.widths.items()))
        out.append(f"| {name} | {'loop' if a['looped'] else 'whole kernel'} | {a['num_warps']} | {a['registers']} | "
                   f"{a['shared']} | {a['resident']} | {c.issued} | {widths} | {c.classes['shared load']} / "
                   f"{c.classes['shared store']} | {c.classes['fma']} / {c.classes['alu']} | {c.classes['shuffle']} | "
                   f"{c.classes['conversion']} | {c.classes['special']} | {c.barriers} | {c.wavefronts:.0f} |")
    return out


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", nargs="+", default=list(MEASURED), choices=list(MEASURED))
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent, help="git checkout holding 9c57ff6")
    parser.add_argument("--commit", default="9c57ff6", help="the measured commit")
    parser.add_argument("--no-old", action="store_true", help="only today's kernels")
    parser.add_argument("--operands", choices=("float32", "bfloat16"),
                        help="today's kernels with these tl.dot operands (decode_launches' operands; default: the "
                             "library's, the query's type: bfloat16 here)")
    parser.add_argument("--sweep", type=Path, metavar="BENCHMARKS.md",
                        help="only: predict every launch configuration measured in this file's sweep section")
    args = parser.parse_args(argv)
    # a fresh kernel cache: a cached kernel of the same source carries the line numbers of the file it was
    # first compiled from, and the L1 term matches SASS, TTGIR and interpreted accesses by source line
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kernel_model_")
    if args.sweep:
        body = "\n".join(sweep_check(args.sweep))
        print(body)
        return body
    lines, tiles, hosts = [], [], []
    if not args.no_old:
        split = old_module(args.repo, args.commit, "kvcomp/kernels/decode_attention_triton.py")
        lines += [f"Kernels of {args.commit} against their measured times (H100, gpu-evidence; ratio = predicted / measured):",
                  "", "| codec | batch x context | predicted ms | bound | measured ms | ratio |", "|---|---|---:|---|---:|---:|"]
        predicted = {}
        for name in args.codecs:
            result = old_step(split, name, OLD_SHAPES)
            tiles += [(f"{args.commit} {name}", a) for a in result["launches"]]
            hosts.append((f"{args.commit} {name}", result["host"], None))
            for shape, (seconds, bound) in result["shapes"].items():
                predicted.setdefault(shape, {})[name] = seconds * 1e3
                ms = MEASURED[name][shape]
                lines.append(f"| {name} | {shape[0]} x {shape[1] // 1024}K | {seconds * 1e3:.3f} | {bound} | {ms:.3f} | "
                             f"{seconds * 1e3 / ms:.2f} |")
        lines += ["", "Ranking of the measured kernels per shape (fastest first):", ""]
        lines += [ranking_line(shape, times, {n: MEASURED[n][shape] for n in times}) for shape, times in predicted.items()]
        qjl = qjl_scores(old_module(args.repo, args.commit, "kvcomp/kernels/qjl_scores_triton.py"), QJL_MEASURED)
        tiles += [(f"{args.commit} qjl scores", qjl["launches"][0])]
        hosts.append((f"{args.commit} qjl scores", qjl["host"], None))
        lines += ["", "| QJL scores (authors' general layer) | batch x context | predicted ms | measured ms | ratio |",
                  "|---|---|---:|---:|---:|"]
        for shape, (seconds, _) in qjl["shapes"].items():
            lines.append(f"| {args.commit} | {shape[0]} x {shape[1] // 1024}K | {seconds * 1e3:.3f} | {QJL_MEASURED[shape]:.3f} | "
                         f"{seconds * 1e3 / QJL_MEASURED[shape]:.2f} |")
    options = {"operands": args.operands} if args.operands else None
    where = f"{MEASURED_TODAY_CARD}, {MEASURED_TODAY_AT}"
    lines += ["", "Today's kernels, predicted (static model); SDPA bf16 memory time = K/V bytes / 2970 GB/s; measured: the "
              f"{where} rows of BENCHMARKS.md where a launch's machine code is the one measured (ratio = predicted / "
              "measured):", "",
              "| codec | batch x context | predicted ms | bound | SDPA memory ms | vs SDPA memory | measured ms | ratio | "
              "device part ms | measured device ms | ratio |",
              "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]

    def row(name: str, shape: tuple, seconds: float, bound: str, measured: dict, as_measured: bool, host: float) -> str:
        """A predicted step beside the measured one; its device part (less the host term) beside the measured device
        time (:data:`MEASURED_TODAY_DEVICE`)."""
        sdpa = 2 * shape[0] * H * shape[1] * D * 2 / 2970e9 * 1e3
        ms = measured.get(shape) if as_measured else None
        device = (seconds - HOST_FACTOR * host) * 1e3
        on_device = MEASURED_TODAY_DEVICE.get((name, shape)) if as_measured else None
        return (f"| {name} | {shape[0]} x {shape[1] // 1024}K | {seconds * 1e3:.3f} | {bound} | {sdpa:.3f} | "
                f"{sdpa / (seconds * 1e3):.2f}x | {f'{ms:.3f}' if ms else '-'} | {f'{seconds * 1e3 / ms:.2f}' if ms else '-'} | "
                f"{device:.3f} | {f'{on_device:.3f}' if on_device else '-'} | {f'{device / on_device:.2f}' if on_device else '-'} |")

    device_parts = {}  # shape -> name -> predicted device part, where the device time was measured

    def step_rows(name: str, result: dict) -> None:
        for shape, (seconds, bound) in result["shapes"].items():  # (the measured launches were capped; a batch of one
            as_measured = result["sass"][shape] == MEASURED_TODAY_SASS[name]  # now runs uncapped)
            if as_measured and (name, shape) in MEASURED_TODAY_DEVICE:
                device_parts.setdefault(shape, {})[name] = (seconds - HOST_FACTOR * result["host"]) * 1e3
            lines.append(row(name, shape, seconds, bound, MEASURED_TODAY[name], as_measured, result["host"]))

    for name in args.codecs:
        result = today_step(name, SHAPES, options)
        tiles += [(f"today {name}", a) for a in result["launches"]]
        hosts.append((f"today {name}", result["host"], result["graphed"]))
        step_rows(name, result)
    fused = today_step("qjl", SHAPES, options)  # QJL's step in the fused kernel (sketched keys, packed values)
    tiles += [("today qjl step", a) for a in fused["launches"]]
    hosts.append(("today qjl step", fused["host"], fused["graphed"]))
    step_rows("qjl step", fused)
    qjl = qjl_scores(None, SHAPES + [s for s in QJL_MEASURED_TODAY if s not in SHAPES])
    tiles += [("today qjl scores", qjl["launches"][0])]
    hosts.append(("today qjl scores", qjl["host"], None))
    for shape, (seconds, bound) in qjl["shapes"].items():
        lines.append(row("qjl scores", shape, seconds, bound, QJL_MEASURED_TODAY,
                         qjl["launches"][0]["sass"] == MEASURED_TODAY_SASS["qjl scores"], qjl["host"]))
    if device_parts:  # device time: the host term is this CPU's, not the GPU machine's
        lines += ["", f"Ranking of today's kernels per shape by device time (fastest first; those measured on the {where}):",
                  ""]
        lines += [ranking_line(shape, parts, {n: MEASURED_TODAY_DEVICE[n, shape] for n in parts})
                  for shape, parts in sorted(device_parts.items())]
    lines += ["", "Host time of one call on this CPU (the launcher's Python and Triton's binding of its launches; the "
              "fastest of several, without the driver's launch; with CUDA graphs: a call replayed by its inputs, "
              "without the replay itself):", "", "| kernel | host ms | host ms with CUDA graphs |", "|---|---:|---:|"]
    lines += [f"| {name} | {seconds * 1e3:.3f} | {'-' if graphed is None else f'{graphed * 1e3:.3f}'} |"
              for name, seconds, graphed in hosts]
    lines += ["", "Per tile and warp (sm_90a SASS):", ""] + tile_table(tiles)
    body = "\n".join(lines)
    print(body)
    return body


if __name__ == "__main__":
    main()
