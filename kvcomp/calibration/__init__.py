"""Calibration: the data a codec is fitted on, and the cached, checked artifacts ``fit`` produces.

A fitted state is saved once per (model fingerprint, codec config, calibration set, library version)
under ``cache_dir()/calibration/`` and reused by later runs: a changed model (other weights, config or
tokenizer under the same name) gets a fresh fit. Loading an artifact fitted for anything else is a
:class:`~kvcomp.errors.CalibrationMismatchError` that lists what differs; a damaged one (truncated,
altered, non-finite) is an error that names the file and the remedy.

Requests are bounded: more windows than the corpus holds side by side are refused unless
``calibration.oversample`` (:func:`check_windows`), and a K/V collection the cache disk cannot hold is refused
before the model loads (:func:`check_collection`) and again before it is written.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import kvcomp
from kvcomp.artifacts import file_lock
from kvcomp.calibration.collect import (RECORD, KVActivations, check_disk, collect_kv, collection_shape, kv_root,
                                       remove_incomplete)
from kvcomp.calibration.queries import query_moments
from kvcomp.codecs import Codec, CodecState, needs_calibration
from kvcomp.errors import ConfigError
from kvcomp.paths import cache_dir, cache_relative
from kvcomp.schema import at_least


@dataclass
class CalibrationConfig:
    """Text a codec is fitted on (ignored by codecs that need no calibration)."""

    name: str = "enwiki"
    num_samples: int = 16
    seq_len: int = 512
    seed: int = 0  # where the windows start, within the calibration documents (always those disjoint from evaluation's)
    artifact: str | None = None  # a fitted codec state to use instead of the cache's (refused if fitted for another model)
    oversample: bool = False  # allow more windows than the corpus holds side by side (they then overlap)

    def __post_init__(self):
        at_least(self, 1, "num_samples")
        at_least(self, 2, "seq_len")


NOT_IDENTITY = ("artifact", "oversample")  # fields that do not change which windows are drawn


def check_windows(corpus_tokens: int, calibration: CalibrationConfig) -> None:
    """Raise :class:`ConfigError` when ``num_samples`` windows of ``seq_len`` tokens need more tokens than the
    corpus holds (``corpus_tokens``), naming how many windows it holds without overlap, unless
    ``calibration.oversample``. (Windows are drawn at seeded random offsets either way, so they may overlap
    partly even within the bound.)"""
    n, seq_len = calibration.num_samples, calibration.seq_len
    disjoint = corpus_tokens // seq_len
    if n > disjoint and not calibration.oversample:
        raise ConfigError(
            f"calibration.num_samples={n} windows of calibration.seq_len={seq_len} tokens need {n * seq_len} tokens, "
            f"but the {calibration.name!r} calibration corpus has {corpus_tokens}: {disjoint} windows without "
            "overlap; lower calibration.num_samples or calibration.seq_len, or set calibration.oversample=true to "
            "draw overlapping windows"
        )


def check_collection(codec: Codec, calibration: CalibrationConfig) -> None:
    """Before the model loads: remove incomplete K/V collections of killed runs, then refuse the collection
    ``codec`` would need when the cache disk cannot hold it (:func:`~kvcomp.calibration.collect.check_disk`).
    Passes when a complete collection of the same shape is cached: it may serve (its key needs the model's
    fingerprint), and the collection is checked again before it is written."""
    root = kv_root()
    remove_incomplete(root)
    shape = collection_shape(codec.model, calibration.num_samples, calibration.seq_len, codec.calibration_drop_first)
    if list(shape) in _cached_shapes(root):
        return
    check_disk(KVActivations(root, shape, codec.model.num_layers, codec.needs_fisher))


def _cached_shapes(root: Path) -> list:
    """The shard shapes the complete collections under ``root`` record (unreadable records are skipped: they
    are verified, and refused, where they would be reused)."""
    shapes = []
    for record in root.glob(f"*/{RECORD}"):
        try:
            shapes.append(json.loads(record.read_text()).get("shape"))
        except (OSError, ValueError, AttributeError):
            continue
    return shapes


@dataclass
class CalibrationData:
    """The calibration windows and the model they run through: :meth:`activations` collects what
    ``Codec.fit`` receives (codecs never see the model, nor import calibration)."""

    model: torch.nn.Module
    tokenizer: object
    windows: torch.Tensor  # [num_samples, seq_len]
    config: CalibrationConfig
    force: bool = False  # collect again even when a verified collection is cached

    def activations(self, codec: Codec) -> KVActivations:
        """What ``codec.fit`` receives: pre-RoPE keys and values of every window, without the codec's
        :attr:`~kvcomp.codecs.base.Codec.calibration_drop_first` leading tokens, with Fisher weights only
        when it :attr:`~kvcomp.codecs.base.Codec.needs_fisher` (:func:`~kvcomp.calibration.collect.collect_kv`:
        reused from the cache folder when a verified collection of the same model and windows exists,
        unless ``force``), and the queries' second moments when it ``needs_queries``
        (:func:`~kvcomp.calibration.queries.query_moments`, not cached: the fitted state is)."""
        activations = collect_kv(self.model, codec.model, self.windows, codec.calibration_drop_first,
                                 force=self.force, fisher=codec.needs_fisher)
        types = {codec.model.layer_types[i] for i in codec.model.model_layers} if codec.model.layer_types else {None}
        ropes = [window_rope(self.model, self.windows.shape[1], codec.calibration_drop_first, kind) for kind in types]
        same = all(r is not None and all(torch.equal(a, b) for a, b in zip(r, ropes[0])) for r in ropes)
        activations.rope = ropes[0] if same else None  # layers with different RoPE (Gemma 3): no shared angles
        activations.biases = attention_biases(self.model, codec.model)
        if codec.needs_queries:
            activations.query_moments = query_moments(self.model, codec.model, self.windows, codec.calibration_drop_first)
        return activations


def attention_biases(model, info) -> dict[int, dict[str, torch.Tensor]] | None:
    """Per codec layer, the k_proj / v_proj biases ``[kv_heads, head_dim]`` (float32, CPU) of ``model``'s attention
    modules; None when its attention has no biases (e.g. Llama)."""
    modules = {m.layer_idx: m for name, m in model.named_modules() if name.endswith("self_attn") and hasattr(m, "layer_idx")}
    biases = {}
    for layer, model_layer in enumerate(info.model_layers):
        module = modules.get(model_layer)
        found = {kind: getattr(getattr(module, proj, None), "bias", None) for kind, proj in (("key", "k_proj"), ("value", "v_proj"))}
        if all(b is not None for b in found.values()):
            biases[layer] = {kind: b.detach().float().cpu().view(info.num_kv_heads, info.head_dim) for kind, b in found.items()}
    return biases or None


def window_rope(model, seq_len: int, drop_first: int, layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos/sin ``[seq_len - drop_first, head_dim]`` (float32) of a window's kept positions, from the model's
    rotary embedding (of ``layer_type`` where it has one per layer type; None for models without one)."""
    rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
    if rotary is None:
        return None
    parameter = next(model.parameters())
    extra = (layer_type,) if layer_type is not None and hasattr(rotary, f"{layer_type}_inv_freq") else ()
    with torch.no_grad():
        cos, sin = rotary(parameter[:1], torch.arange(seq_len, device=parameter.device)[None], *extra)
    return cos[0, drop_first:].float(), sin[0, drop_first:].float()


def fitted_for(codec: Codec, calibration: CalibrationConfig) -> dict:
    """What an artifact records about its origin; every field must match to reuse it."""
    return {
        "model": codec.model.identity,
        "model_shape": [codec.model.num_layers, codec.model.num_kv_heads, codec.model.head_dim],
        "codec": codec.calibration_key(),
        "calibration": {k: v for k, v in asdict(calibration).items() if k not in NOT_IDENTITY},
        "kvcomp_version": kvcomp.__version__,
    }


def artifact_path(codec: Codec, calibration: CalibrationConfig) -> Path:
    """Where the state for this codec, model and calibration set is cached."""
    key = hashlib.sha256(json.dumps(fitted_for(codec, calibration), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "calibration" / f"{codec.name}-{key}.safetensors"


def fit_state(codec: Codec, activations, source: str) -> CodecState:
    """``codec.fit(activations)``, refused when the state holds NaN or Inf (naming ``source``, what it was fitted on)."""
    state = codec.fit(activations)
    state.check_finite(f"{codec.name} calibration (fitted on {source})")
    return state


def calibrate(codec: Codec, calibration: CalibrationConfig, load_activations, path: Path | None = None,
              force: bool = False) -> dict:
    """Install a fitted state into ``codec``: load the cached artifact or fit and save one.

    ``load_activations()`` returns what ``codec.fit`` receives, e.g.
    ``CalibrationData(...).activations(codec)`` (called only when fitting). ``path``: an
    artifact to use instead of the cache's (refused if fitted for another model or config); ``force``
    refits and overwrites it. A state with NaN or Inf is refused (not saved). Processes calibrating the same
    artifact at once fit it once: the first holds a lock on it while fitting, the others wait, then load it.
    Returns a small report
    (``{"artifact": ..., "reused": bool, "seconds": float}``; the artifact path relative to the cache
    folder when it lies there); codecs that need no calibration return ``{}``.
    """
    if not needs_calibration(codec):
        return {}
    expected = fitted_for(codec, calibration)
    path = Path(path) if path is not None else artifact_path(codec, calibration)
    start = time.perf_counter()
    with file_lock(path, f"the {codec.name} calibration {path.name}"):  # concurrent sweep members fit once
        reused = path.is_file() and not force
        if reused:
            codec.install_state(CodecState.load(path, expected))
        else:
            state = fit_state(codec, load_activations(), calibration.name)
            state.fitted_for = expected
            state.save(path)
            codec.install_state(state)
    return {"artifact": cache_relative(path), "reused": reused, "seconds": round(time.perf_counter() - start, 2)}

