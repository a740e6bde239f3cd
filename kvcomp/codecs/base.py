"""The codec contract shared by every KV-cache compression method.

A codec turns blocks of cached keys and values ``[batch, kv_heads, tokens, head_dim]`` into a
:class:`Payload` and back. The cache (not the codec) decides when a block is encoded, following each
stream's :class:`StreamPolicy`: full-precision sink tokens, blocks of ``block_size`` tokens, and a
full-precision window of recent tokens. What one encode call sees is the codec's **scope**:

- ``"stream"``: one layer's keys *or* values;
- ``"layer"``: keys and values of one layer together, with the previous layer's reconstruction of the
  same tokens (AQUA-KV's predictors);
- ``"model"``: every layer's keys and values of a token block at once, encoded once the last layer has
  appended it (kvtc's cross-layer PCA).

Every scope has the same two calls, :meth:`Codec.encode` and :meth:`Codec.decode`, with its own request type:
:class:`StreamRequest` (``layer``, ``kind``, ``tokens``), :class:`LayerRequest` (``layer``, ``keys``, ``values``,
``previous``) or :class:`ModelRequest` (``keys`` and ``values`` over layers, ``encoded_before``; decode: ``layer``),
each a :class:`Request`, which holds what every scope shares (``state``, ``dtype``, ``kernel_backend``,
``range_checks``).

Capabilities beyond encode and decode are small mixins: :class:`Calibrated` (fitted on calibration
activations), :class:`Stateful` (per-sequence state, e.g. CSR's dictionary of atoms sampled from the prompt,
made by :meth:`Stateful.init_state` at a unit's first encode, held, counted and batch-reordered by the cache,
and passed to every encode and decode), :class:`FusedPayload` (read by the fused decode-attention kernel),
:class:`PayloadScores` and :class:`PayloadValues` (attention from the payload with the codec's own code).
A codec declares a capability by inheriting its mixin. Where its configuration decides whether the capability is
used, the mixin has one method saying so, True unless the codec overrides it with its rule:
:meth:`Calibrated.calibrates`, :meth:`Stateful.keeps_state`, :meth:`FusedPayload.fused_attention_supported`
(per layer) and :meth:`PayloadValues.uses_payload_values`; callers ask :func:`needs_calibration`,
:func:`keeps_state`, :func:`reads_fused` and :func:`values_from_payload`, which check the mixin too.

Payloads are stored as a list of blocks; appending never copies what is stored. With
``payload_layout = "tokens"`` their tensors have tokens on dim 2 and consecutive blocks read as one
payload (what fused kernels read); ``"blocks"`` keeps each block's payload apart, which allows
variable-length (entropy-coded) and ragged per-row data (:attr:`Payload.ragged`).

Bit accounting: the cache's measured bytes are the numbers reported, split into encoded payloads,
full-precision tokens and per-sequence state. For fixed-rate codecs :meth:`Codec.code_bits_per_value`
is the exact storage of one encoded value (codes, scales, zero-points, norms, outliers, ...) and
:func:`expected_cache_bits` turns a policy and a token count into the bits the cache must hold;
amortised model-level overheads (codebooks, dictionaries, predictors, PCA bases) are reported apart by
:meth:`Codec.overhead_bits`.
"""

from __future__ import annotations

import hashlib
import json
import re
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvcomp.artifacts import REFIT, ArtifactError, atomic_path, tensors_nbytes
from kvcomp.errors import CalibrationMismatchError, ConfigError, NonFiniteStateError
from kvcomp.kernels.formats import OffsetReader

KINDS = ("key", "value")
SCOPES = ("stream", "layer", "model")
PAYLOAD_LAYOUTS = ("tokens", "blocks")


@dataclass
class CodecConfig:
    """Fields shared by every codec config; each codec subclasses this with its own fields.

    ``compress_sliding``: on models with sliding-window layers, encode those too (their cache then keeps
    every token, encoded, and the attention mask applies the window); by default they keep an
    uncompressed window-bounded cache and only full-attention layers are encoded."""

    name: str = "fp16"
    compress_sliding: bool = False  # sliding-window layers: also encode them (default: an uncompressed window)


@dataclass(frozen=True)
class ModelInfo:
    """Shapes a codec needs, read from the HF config (never restated in YAML)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    has_rope: bool = True
    fingerprint: str = ""  # :func:`kvcomp.models.fingerprint.model_fingerprint`; keys every cache when set
    # Hybrid / sliding-window models: the attention type of every decoder layer (empty: all full attention),
    # the window, and which model layers the codec's layers 0 .. num_layers-1 are (empty: the same indices).
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    layers: tuple[int, ...] = ()

    @classmethod
    def from_hf_config(cls, config, name: str | None = None, fingerprint: str = "") -> "ModelInfo":
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        has_rope = bool(
            getattr(text, "rope_parameters", None)
            or getattr(text, "rope_theta", None)
            or getattr(text, "rotary_dim", None)
            or getattr(text, "rotary_pct", None)
            or getattr(text, "position_embedding_type", None) == "rotary"
        )
        layer_types = attention_layer_types(text)
        return cls(
            name=name or getattr(config, "_name_or_path", "") or text.model_type,
            num_layers=text.num_hidden_layers,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            has_rope=has_rope,
            fingerprint=fingerprint,
            layer_types=() if set(layer_types) == {FULL} else tuple(layer_types),
            sliding_window=getattr(text, "sliding_window", None) if SLIDING in layer_types else None,
        )

    @property
    def total_layers(self) -> int:
        """Decoder layers of the model (:attr:`num_layers` counts those the codec encodes)."""
        return len(self.layer_types) or self.num_layers

    @property
    def model_layers(self) -> tuple[int, ...]:
        """The model layer of each codec layer."""
        return self.layers or tuple(range(self.num_layers))

    def encoding(self, sliding: bool) -> "ModelInfo":
        """The view a codec works on: the full-attention layers, and the sliding-window ones if ``sliding``,
        renumbered 0 .. n-1 (:attr:`layers` maps them back). A model without sliding layers is unchanged."""
        if not self.layer_types or self.layers:
            return self
        kept = tuple(i for i, kind in enumerate(self.layer_types) if kind == FULL or sliding)
        if not kept:
            raise ConfigError(f"every layer of {self.name} uses sliding-window attention (window {self.sliding_window}): "
                              "nothing to compress; set codec.compress_sliding=true to encode them")
        return replace(self, num_layers=len(kept), layers=kept)

    @property
    def identity(self) -> str:
        """What cache keys use: the fingerprint (content), or the name when none was computed."""
        return f"fingerprint:{self.fingerprint}" if self.fingerprint else f"name:{self.name}"


FULL, SLIDING = "full_attention", "sliding_attention"


def attention_layer_types(text_config) -> list[str]:
    """``full_attention`` / ``sliding_attention`` of every decoder layer: the config's ``layer_types``, or
    every layer sliding when it sets a ``sliding_window`` without them (Mistral); other kinds (chunked,
    linear, shared) are refused."""
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is None:
        windowed = getattr(text_config, "sliding_window", None) is not None and getattr(text_config, "use_sliding_window", True)
        layer_types = [SLIDING if windowed else FULL] * text_config.num_hidden_layers
    unknown = sorted(set(layer_types) - {FULL, SLIDING})
    if unknown:
        raise NotImplementedError(f"{text_config.model_type}: layer types {unknown} are not supported by the compressed "
                                  f"cache (supported: {FULL}, {SLIDING})")
    return list(layer_types)


@dataclass(frozen=True)
class StreamPolicy:
    """When the cache encodes one stream (keys or values) of a layer.

    The first ``sinks`` tokens stay in full precision. After them, tokens enter a full-precision tail;
    whenever the tail holds ``window + block_size`` tokens, its oldest ``block_size`` tokens are encoded.
    ``block_size=None`` never encodes (the uncompressed reference).
    """

    sinks: int = 0
    block_size: int | None = 1
    window: int = 0

    def split(self, num_tokens: int) -> tuple[int, int, int]:
        """``(sinks, encoded, tail)`` token counts after ``num_tokens`` tokens have streamed in."""
        sinks = min(num_tokens, self.sinks)
        rest = num_tokens - sinks
        if self.block_size is None or rest < self.window + self.block_size:
            return sinks, 0, rest
        encoded = (rest - self.window) // self.block_size * self.block_size
        return sinks, encoded, rest - encoded


def _select_rows(tensors: dict[str, torch.Tensor], ragged: dict[str, list[torch.Tensor]], index: torch.Tensor):
    rows = index.tolist() if ragged else None
    return (
        {k: v.index_select(0, index.to(v.device)) for k, v in tensors.items()},
        {k: [v[i] for i in rows] for k, v in ragged.items()},
    )


def _nbytes(tensors: dict[str, torch.Tensor], ragged: dict[str, list[torch.Tensor]]) -> int:
    held = [*tensors.values(), *(t for rows in ragged.values() for t in rows)]
    return sum(t.numel() * t.element_size() for t in held)


@dataclass
class Payload:
    """Encoded tokens: named tensors with the batch on dim 0 (and, for ``payload_layout="tokens"``, tokens
    or token groups on dim 2, so consecutive payloads concatenate along it), plus ``ragged`` data: per
    batch row, one tensor of any length (entropy-coded bytes, a variable number of atoms, ...)."""

    tensors: dict[str, torch.Tensor]
    num_tokens: int
    ragged: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes actually held by the tensors (ragged rows included)."""
        return _nbytes(self.tensors, self.ragged)

    def concat(self, other: "Payload") -> "Payload":
        return Payload(
            {k: torch.cat([v, other.tensors[k]], dim=2) for k, v in self.tensors.items()},
            self.num_tokens + other.num_tokens,
        )

    def map(self, fn) -> "Payload":
        """Apply ``fn`` to every tensor, ragged rows included (device moves, dtype casts)."""
        return Payload(
            {k: fn(v) for k, v in self.tensors.items()},
            self.num_tokens,
            {k: [fn(t) for t in rows] for k, rows in self.ragged.items()},
        )

    def select_rows(self, index: torch.Tensor) -> "Payload":
        """The payload of batch rows ``index`` (beam reorder, batch select / repeat)."""
        tensors, ragged = _select_rows(self.tensors, self.ragged, index)
        return Payload(tensors, self.num_tokens, ragged)


@dataclass
class SequenceState:
    """What a ``stateful`` codec keeps per sequence (e.g. CSR's atoms sampled from the prompt): tensors with
    the batch on dim 0 and ragged per-row tensors. Held by the cache, counted in its bytes, moved with
    the batch; the codec may grow it (replace entries) during :meth:`Codec.encode`."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    ragged: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.tensors, self.ragged)

    def select_rows(self, index: torch.Tensor) -> None:
        self.tensors, self.ragged = _select_rows(self.tensors, self.ragged, index)


@dataclass(frozen=True)
class CacheStatistics:
    """What a filled cache holds, as the cache reports it to :meth:`Codec.example_metrics` (the codec never
    reads the cache itself): over the key and value ``streams`` of the encoded layers, ``cached_tokens`` and
    ``encoded_tokens`` (sums over streams, per batch row), the bytes of their full-precision tokens, payloads
    and per-sequence state (all rows), and a model-scope codec's ``shared_payloads`` (its blocks) and
    ``shared_state``."""

    batch: int
    streams: int
    cached_tokens: int
    encoded_tokens: int
    full_precision_nbytes: int
    payload_nbytes: int
    state_nbytes: int
    shared_payloads: tuple = ()
    shared_state: "SequenceState | None" = None


@dataclass(frozen=True)
class Unit:
    """One encoding unit of a codec's scope: a stream (``layer`` and ``kind`` set), a layer (``kind`` None)
    or the whole model (both None)."""

    layer: int | None = None
    kind: str | None = None


@dataclass(kw_only=True)
class Request:
    """What every scope's encode or decode call carries; the cache (:mod:`kvcomp.cache.scopes`) builds its
    scope's subclass, :class:`StreamRequest`, :class:`LayerRequest` or :class:`ModelRequest`.

    ``state``: the unit's per-sequence state (:class:`Stateful` codecs; None otherwise); decode: ``dtype`` of
    what it returns; encode: ``kernel_backend`` (``"triton"``: the codec may encode with its kernel) and
    ``range_checks``, which the codec passes to every range check of the block (:mod:`kvcomp.stages.ranges`): None
    checks on the host, a list (``check_finite="deferred"``) gets the device verdicts the cache reads later."""

    state: "SequenceState | None" = None
    dtype: torch.dtype | None = None
    kernel_backend: str = "torch"
    range_checks: list | None = None

    def __post_init__(self):
        if type(self) is Request:
            raise TypeError("Request is the base of StreamRequest, LayerRequest and ModelRequest: build the scope's own")


@dataclass
class StreamRequest(Request):
    """A stream-scope call: layer ``layer``'s ``kind`` stream; encode: its ``tokens [B, H, T, D]``."""

    layer: int
    kind: str
    tokens: torch.Tensor | None = None


@dataclass
class LayerRequest(Request):
    """A layer-scope call on layer ``layer``; encode: its ``keys`` and ``values [B, H, T, D]``; both:
    ``previous``, the previous layer's reconstruction ``(keys, values)`` of the same tokens (None for layer 0)."""

    layer: int
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    previous: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class ModelRequest(Request):
    """A model-scope call; encode: ``keys`` and ``values``, lists over layers of ``[B, H, T, D]``, and
    ``encoded_before``, the tokens of the sequence earlier blocks encoded; decode: ``layer``, the layer to
    reconstruct."""

    layer: int | None = None
    keys: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None
    encoded_before: int = 0


@dataclass
class LayerEncoding:
    """What a layer-scope :meth:`Codec.encode` returns: both payloads and the layer's reconstruction of the
    block (``keys``/``values`` as decode would give them), which the next layer's encode receives as
    ``previous``."""

    key: Payload
    value: Payload
    keys: torch.Tensor
    values: torch.Tensor


@dataclass
class CodecState:
    """What ``fit`` learned (codebooks, statistics, ...) plus what it was fitted for.

    Saved as one safetensors file whose header holds ``fitted_for`` and a sha256 over ``fitted_for`` and
    every tensor, so a truncated, altered or re-labelled file is refused on load (:meth:`load`)."""

    tensors: dict[str, torch.Tensor]
    fitted_for: dict[str, Any] = field(default_factory=dict)

    def checksum(self) -> str:
        digest = hashlib.sha256(json.dumps(self.fitted_for, sort_keys=True).encode())
        for name in sorted(self.tensors):
            tensor = self.tensors[name].detach().contiguous().cpu()
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def check_finite(self, where: str) -> None:
        """Raise :class:`NonFiniteStateError` naming the first tensor (layer and field) with NaN or Inf."""
        for name, tensor in self.tensors.items():
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                layer = re.match(r"layer(\d+)\.(.+)", name)
                what = f"layer {layer[1]}, field {layer[2]!r}" if layer else f"field {name!r}"
                raise NonFiniteStateError(f"{where}: {what} holds NaN or Inf")

    def save(self, path: str | Path) -> None:
        """Write ``path`` (safetensors, metadata and checksum in its header) atomically."""
        tensors = {k: v.contiguous().cpu() for k, v in self.tensors.items()}
        metadata = {"fitted_for": json.dumps(self.fitted_for, sort_keys=True), "sha256": self.checksum()}
        with atomic_path(path, tensors_nbytes(tensors)) as tmp:
            save_file(tensors, str(tmp), metadata=metadata)

    @classmethod
    def load(cls, path: str | Path, expected_for: dict[str, Any]) -> "CodecState":
        """Load ``path``; raise :class:`CalibrationMismatchError` listing every field that differs, and
        :class:`~kvcomp.artifacts.ArtifactError` (naming the file and the remedy) when it is damaged."""
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
            fitted_for = json.loads(metadata["fitted_for"])
            tensors = load_file(str(path))
        except Exception as err:  # truncated or garbled file / header
            raise ArtifactError(
                f"calibration artifact {path} is unreadable ({type(err).__name__}: {err}); {REFIT}"
            ) from err
        differences = [
            f"{key}: artifact has {fitted_for.get(key)!r}, run wants {expected_for.get(key)!r}"
            for key in sorted(set(fitted_for) | set(expected_for))
            if fitted_for.get(key) != expected_for.get(key)
        ]
        if differences:
            raise CalibrationMismatchError(
                f"calibration artifact {path} was fitted for something else:\n  " + "\n  ".join(differences)
            )
        state = cls(tensors=tensors, fitted_for=fitted_for)
        if metadata.get("sha256") != state.checksum():
            raise ArtifactError(f"calibration artifact {path} fails its sha256 checksum (altered or damaged); {REFIT}")
        state.check_finite(f"calibration artifact {path}")
        return state


class Activations(ABC):
    """What :meth:`Codec.fit` receives: activations of the calibration windows, collected once, cached on
    disk and shared by every codec fitted on the same model and windows.

    :meth:`layer` gives, for one decoder layer, ``"key"`` (pre-RoPE) and ``"value"`` tensors
    ``[samples, kv_heads, tokens, head_dim]`` and, for codecs whose :attr:`Codec.needs_fisher`, their
    Fisher weights ``"key_grad2"`` / ``"value_grad2"`` (squared gradients of the mean next-token loss).
    ``device``: where fitting should compute (the model's device). ``rope``: cos/sin ``[tokens, head_dim]``
    of the windows' positions (the same for every window; None without RoPE), for codecs that fit on
    post-RoPE keys (``apply_rope``). ``biases``: per codec layer, the model's k_proj / v_proj biases ``[kv_heads,
    head_dim]`` by kind (``"key"``, ``"value"``; None for a model without them), for codecs that centre on them.
    ``query_moments``: for codecs that :attr:`Calibrated.needs_queries`, per codec layer the second moment ``E[q q^T]``
    ``[kv_heads, head_dim, head_dim]`` (float32) of the post-RoPE queries each KV head meets (None otherwise).
    Closed-loop fits, which see earlier layers' reconstructions, run :func:`fit_layer_by_layer` over them.
    """

    num_layers: int
    shape: tuple[int, int, int, int]
    device: torch.device
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    biases: dict[int, dict[str, torch.Tensor]] | None = None
    query_moments: dict[int, torch.Tensor] | None = None

    @abstractmethod
    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        """The fields of layer ``layer`` (see the class docstring)."""


def fit_layer_by_layer(activations: Activations, fit_layer) -> list:
    """Closed-loop fitting (AQUA-KV Alg. 1): ``fit_layer(layer, fields, previous)`` fits layer ``layer`` on
    its activations and ``previous``, what the call for layer ``layer - 1`` returned as its
    reconstruction (None for layer 0), and returns ``(fitted, reconstruction)``; the fitted parts come
    back in layer order. Each layer is fitted on what inference will give it: earlier layers' decoded,
    not original, K/V."""
    fitted, previous = [], None
    for layer in range(activations.num_layers):
        part, previous = fit_layer(layer, activations.layer(layer), previous)
        fitted.append(part)
    return fitted


class Codec(ABC):
    """Base class of every codec. Subclasses set ``config_class`` and register themselves with
    :func:`~kvcomp.codecs.registry.register`, which sets ``name`` from the config's ``name`` default."""

    name: ClassVar[str]  # ``config_class.name``'s default, set by ``@register``
    config_class: ClassVar[type[CodecConfig]]
    scope: ClassVar[str] = "stream"  # see SCOPES and the module docstring
    payload_layout: ClassVar[str] = "tokens"  # see PAYLOAD_LAYOUTS
    # fields added after rows and artifacts were committed: named (describe) and keyed (calibration_key) only when
    # they differ from these values, so that what was made before keeps its description and artifact key
    quiet_defaults: ClassVar[dict] = {"compress_sliding": False}

    def __init__(self, config: CodecConfig, model: ModelInfo):
        self.config = config
        self.model = model.encoding(getattr(config, "compress_sliding", False))
        self.validate()
        if self.pre_rope and not model.has_rope:
            raise ConfigError(f"codec {self.name} works on pre-RoPE keys but model {model.name} has no RoPE")
        self.build()
        self.check_contract()

    @classmethod
    def encodes_after_forward(cls) -> bool:
        """Whether blocks are encoded once a forward has ended (model scope), so that no forward ever reads a
        block it completed."""
        return cls.scope == "model"

    @property
    def pre_rope(self) -> bool:
        """Whether keys reach :meth:`encode` un-rotated (the cache re-rotates decoded keys)."""
        return bool(getattr(self.config, "pre_rope", False))

    def rotated_key_offset(self, layer_idx: int) -> torch.Tensor | None:
        """A pre-RoPE offset ``c [kv_heads, head_dim]`` the cache takes out of this post-RoPE codec's keys of layer
        ``layer_idx`` (option ``center``): it encodes ``k - R_p c`` and adds ``R_p c`` back to decoded keys, ``R_p``
        the RoPE rotation of the token's position (:class:`~kvcomp.cache.stream.KVStream`); None: nothing."""
        return None

    def validate(self) -> None:
        """Raise :class:`ConfigError` for settings this codec cannot do on this model; sets nothing (what the
        codec works with is made by :meth:`build`, after it)."""

    def build(self) -> None:
        """Make what encode and decode use from the validated config (quantizers, grids, empty calibration
        state); called once by ``__init__``, after :meth:`validate`."""

    def check_contract(self) -> None:
        """Raise :class:`ConfigError` when the class declares an unknown scope or layout, or when a layer-
        or model-scope codec's streams do not share one policy (their blocks must line up)."""
        if self.scope not in SCOPES or self.payload_layout not in PAYLOAD_LAYOUTS:
            raise ConfigError(
                f"codec {self.name}: scope {self.scope!r} / payload_layout {self.payload_layout!r}; "
                f"valid scopes: {', '.join(SCOPES)}; valid layouts: {', '.join(PAYLOAD_LAYOUTS)}"
            )
        layers = range(self.model.num_layers)
        groups = [[(layer, kind) for kind in KINDS] for layer in layers] if self.scope == "layer" else (
            [[(layer, kind) for layer in layers for kind in KINDS]] if self.scope == "model" else [])
        for group in groups:
            policies = {self.policy(kind, layer) for layer, kind in group}
            if len(policies) > 1:
                raise ConfigError(f"codec {self.name}: a {self.scope}-scope codec needs one policy for {group}, got {policies}")

    @abstractmethod
    def policy(self, kind: str, layer_idx: int) -> StreamPolicy:
        """The cache schedule of layer ``layer_idx``'s ``kind`` ("key" or "value") stream."""

    @abstractmethod
    def encode(self, request: Request):
        """Encode one block (``request``: the scope's :class:`Request` subclass); ``T`` is a multiple of the
        policy's block size (model scope: any length). Returns its :class:`Payload`; a layer-scope codec its
        :class:`LayerEncoding`."""

    @abstractmethod
    def decode(self, payload, request: Request):
        """The block back in ``request.dtype``: a stream's ``[B, H, T, D]``; a layer's ``(keys, values)`` from
        ``payload = (key payload, value payload)``; a model-scope block's ``(keys, values)`` of
        ``request.layer``."""

    def check_payload(self, payload: Payload, batch: int, encoded_before: int) -> None:
        """Raise ``ValueError`` naming the problem if a ``payload_layout="blocks"`` ``payload`` is not what
        :meth:`encode` writes for ``payload.num_tokens`` tokens of ``batch`` rows after ``encoded_before`` tokens:
        a stored cache's blocks are checked with it before anything is allocated (:mod:`kvcomp.cache.stored_checks`
        checks ``"tokens"`` blocks itself, against a block it encodes)."""
        raise NotImplementedError(f"codec {self.name} cannot check a stored block: its caches cannot be restored")

    def code_bits_per_value(self, kind: str, layer_idx: int) -> float:
        """Exact stored bits per encoded value of ``kind`` in layer ``layer_idx``: codes plus per-group
        parameters (fixed-rate codecs; variable-rate ones report measured bytes only)."""
        raise NotImplementedError(f"codec {self.name} has no fixed rate: its bits are measured")

    def overhead_bits(self) -> int:
        """Model-level storage amortised over all tokens (codebooks, dictionaries, predictors)."""
        return 0

    def bits_per_value(self) -> float:
        """Mean stored bits per encoded key/value element over layers (the number papers quote)."""
        layers = range(self.model.num_layers)
        total = sum(self.code_bits_per_value(kind, layer) for kind in KINDS for layer in layers)
        return total / (len(KINDS) * self.model.num_layers)

    def paper_bits_per_value(self) -> float:
        """Bits per value as the codec's paper counts them (defaults to the exact count)."""
        return self.bits_per_value()

    def example_metrics(self, stats: CacheStatistics) -> dict[str, float]:
        """Measurements of one example's filled cache (batch row 0; ``stats``: the cache's
        :meth:`~kvcomp.cache.CompressedCache.statistics`) worth reporting per row, e.g. kvtc's measured
        compression ratios; benchmarks give their mean, min and max over examples."""
        return {}

    def summary(self) -> dict:
        """Facts learned at calibration worth reporting beside the results (e.g. hybrid layer choices)."""
        return {}

    def quiet(self, field: str, value) -> bool:
        """Whether ``field`` is left out of descriptions and calibration keys (:attr:`quiet_defaults`)."""
        return field in self.quiet_defaults and self.quiet_defaults[field] == value

    def describe(self) -> str:
        shown = {k: v for k, v in asdict(self.config).items() if k != "name" and not self.quiet(k, v)}
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in shown.items())})"


class Calibrated(ABC):
    """Capability: a codec fitted on calibration activations (:mod:`kvcomp.calibration`). :meth:`fit` learns from
    the windows' :class:`Activations` (never the model) and returns a :class:`CodecState`, saved as a checked
    artifact and installed by :meth:`load_state`; :meth:`calibrates` False: this configuration fits nothing
    (kvtc's per-prompt PCA). ``inference_only_fields``: config fields a fitted state does not
    depend on; ``needs_fisher``: collect Fisher weights (a backward pass per window); ``needs_queries``: the queries'
    second moments (:attr:`Activations.query_moments`, a forward pass per window);
    ``calibration_drop_first``: leading tokens of every window left out (attention sinks)."""

    inference_only_fields: ClassVar[tuple[str, ...]] = ()
    needs_fisher: bool = False
    needs_queries: bool = False
    calibration_drop_first: int = 0

    def calibrates(self) -> bool:
        """Whether this configuration is fitted (the runner calibrates it first); codecs whose config decides
        override this with their rule."""
        return True

    @abstractmethod
    def fit(self, activations: Activations) -> CodecState | None:
        """Learn from the calibration windows' activations."""

    calibrated_with: str | None = None  # sha256 of the installed state (CodecState.checksum), set by install_state

    @abstractmethod
    def load_state(self, state: CodecState) -> None:
        """Install a state returned by :meth:`fit` (or loaded from disk)."""

    def install_state(self, state: CodecState) -> None:
        """:meth:`load_state`, remembering the state's checksum: the calibration's identity, which a stored
        cache carries and its restore compares (:mod:`kvcomp.cache.offload`)."""
        self.load_state(state)
        self.calibrated_with = state.checksum()

    def calibration_key(self) -> dict:
        """The config fields a fitted state depends on (an artifact is reused only when they match; the codec's
        :attr:`~Codec.quiet_defaults` only when set otherwise, so earlier artifacts keep their keys)."""
        return {k: v for k, v in asdict(self.config).items()
                if k not in self.inference_only_fields and not self.quiet(k, v)}


class Stateful(ABC):
    """Capability: per-sequence state (:class:`SequenceState`, e.g. CSR's dictionary of atoms sampled from the
    prompt) per encoding unit, made by :meth:`init_state` at the unit's first encode, held (counted, batch-
    reordered) by the cache and passed as ``state`` to every encode and decode."""

    def keeps_state(self) -> bool:
        """Whether this configuration keeps per-sequence state; codecs whose config decides override this with
        their rule."""
        return True

    @abstractmethod
    def init_state(self, unit: Unit, held: dict[tuple[int, str], torch.Tensor]) -> SequenceState:
        """The per-sequence state of ``unit``, from the full-precision tokens it holds at its first encode
        (``held[(layer, kind)]``: ``[B, H, T, D]``, pre-RoPE keys for pre-RoPE codecs; e.g. the prompt)."""


class FusedPayload(ABC):
    """Capability: the fused decode-attention kernel reads this codec's payloads in registers
    (:mod:`kvcomp.kernels.decode_attention`), keys and values, for the layers :meth:`fused_attention_supported`
    says."""

    def fused_attention_supported(self, layer_idx: int) -> bool:
        """Whether the kernel reads layer ``layer_idx``'s payloads in this configuration (and on this machine);
        codecs whose config decides override this with their rule."""
        return True

    @abstractmethod
    def payload_reader(self, payload: Payload, kind: str, layer_idx: int):
        """A :class:`~kvcomp.kernels.formats.PayloadReader`: how the kernel decodes ``payload`` in registers
        (pre-RoPE keys are rotated by the cache's positions)."""

    def value_offset(self, layer_idx: int) -> torch.Tensor | None:
        """An offset ``c_v [kv_heads, head_dim]`` that layer ``layer_idx``'s value payloads are stored less (option
        ``center``; :meth:`~Codec.decode` adds it back), which the fused kernel adds to the attention output; None:
        nothing. Keys: :meth:`~Codec.rotated_key_offset`."""
        return None

    def fused_offset(self, kind: str, layer_idx: int, device: torch.device) -> torch.Tensor | None:
        """The offset a stream is stored less (keys: the rotated :meth:`~Codec.rotated_key_offset`; values:
        :meth:`value_offset`), float32 ``[H, D]`` on ``device``; codecs that hold it override this to copy it once."""
        offset = self.rotated_key_offset(layer_idx) if kind == "key" else self.value_offset(layer_idx)
        return None if offset is None else offset.to(device, torch.float32).contiguous()

    def fused_reader(self, payload: Payload, kind: str, layer_idx: int):
        """What the fused kernel reads of ``payload``: :meth:`payload_reader`, inside an
        :class:`~kvcomp.kernels.formats.OffsetReader` where the stream is stored less an offset
        (:meth:`fused_offset`)."""
        reader = self.payload_reader(payload, kind, layer_idx)
        device = next(iter(payload.tensors.values())).device
        offset = self.fused_offset(kind, layer_idx, device)
        if offset is None:
            return reader
        return OffsetReader(reader.num_tokens, reader.head_dim, reader, offset, rotated=kind == "key")


class PayloadScores(ABC):
    """Capability: decode steps score the encoded keys from their payload with the codec's own kernel (where the
    fused kernel cannot read the format)."""

    @abstractmethod
    def payload_scores(self, query: torch.Tensor, payload: Payload, layer_idx: int, backend: str = "torch") -> torch.Tensor:
        """Attention logits ``<q, k>`` of queries ``[B, Hq, Tq, D]`` against the encoded (post-RoPE) keys in
        ``payload``, float32 ``[B, Hq, Tq, T]``; ``backend`` picks the kernel ("torch" or "triton")."""


class PayloadValues(ABC):
    """Capability: decode steps weight the encoded values without decoding them (e.g. CSR's ``D u``); decode
    steps then keep no decoded copy of the values."""

    def uses_payload_values(self) -> bool:
        """Whether decode steps of this configuration weight the values from their payload (else they decode
        them); codecs whose config decides override this with their rule."""
        return True

    @abstractmethod
    def payload_values(self, weights: torch.Tensor, payload: Payload, layer_idx: int,
                       state: SequenceState | None = None) -> torch.Tensor:
        """``sum_t weights[..., t] v_t`` over the values encoded in ``payload``: attention weights
        ``[B, Hq, Tq, T]`` -> float32 ``[B, Hq, Tq, D]``."""


def needs_calibration(codec: "Codec | type[Codec]") -> bool:
    """Whether the runner calibrates ``codec`` (:meth:`Calibrated.calibrates`); a class says so only when no config
    can change it, i.e. it keeps the mixin's rule."""
    if isinstance(codec, type):
        return issubclass(codec, Calibrated) and codec.calibrates is Calibrated.calibrates
    return isinstance(codec, Calibrated) and codec.calibrates()


def calibration_identity(codec: "Codec") -> str | None:
    """The checksum of the calibration state ``codec`` encodes with; None for a codec that fits nothing."""
    return codec.calibrated_with if needs_calibration(codec) else None


def keeps_state(codec: "Codec") -> bool:
    """Whether ``codec`` keeps per-sequence state (:meth:`Stateful.keeps_state`)."""
    return isinstance(codec, Stateful) and codec.keeps_state()


def reads_fused(codec: "Codec", layer_idx: int) -> bool:
    """Whether the fused decode-attention kernel reads layer ``layer_idx``'s payloads
    (:meth:`FusedPayload.fused_attention_supported`)."""
    return isinstance(codec, FusedPayload) and codec.fused_attention_supported(layer_idx)


def scores_from_payload(codec: "Codec") -> bool:
    """Whether decode steps score ``codec``'s keys from their payload (:class:`PayloadScores`, in every
    configuration)."""
    return isinstance(codec, PayloadScores)


def values_from_payload(codec: "Codec") -> bool:
    """Whether decode steps weight ``codec``'s values from their payload (:meth:`PayloadValues.uses_payload_values`)."""
    return isinstance(codec, PayloadValues) and codec.uses_payload_values()


def expected_cache_bits(codec: Codec, num_tokens: int, batch: int, fp_bits: int) -> float:
    """Exact bits a compressed cache holds (all layers, keys and values) after ``num_tokens`` tokens.

    Full-precision tokens (sinks and tail) cost ``fp_bits`` per value, encoded ones
    :meth:`Codec.code_bits_per_value`; sliding-window layers the codec leaves alone hold the last
    ``sliding_window - 1`` tokens at ``fp_bits``. The measured bytes of :class:`~kvcomp.cache.CompressedCache`
    must equal this divided by 8.
    """
    values_per_token = batch * codec.model.num_kv_heads * codec.model.head_dim
    windows = codec.model.total_layers - codec.model.num_layers
    total = windows * len(KINDS) * values_per_token * min(num_tokens, (codec.model.sliding_window or 1) - 1) * fp_bits
    for layer in range(codec.model.num_layers):
        for kind in KINDS:
            sinks, encoded, tail = codec.policy(kind, layer).split(num_tokens)
            total += values_per_token * ((sinks + tail) * fp_bits + encoded * codec.code_bits_per_value(kind, layer))
    return total
