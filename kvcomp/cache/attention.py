"""The ``kvcomp`` attention function and :func:`install`, which connects a model to cache layers that take the
context of each forward (:mod:`kvcomp.cache.context`: how the context reaches them; :mod:`kvcomp.cache.reads`: what
attention then reads)."""

from __future__ import annotations

import contextlib
import weakref

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvcomp.cache.reads import Reads
from kvcomp.cache.rows import ByRows
from kvcomp.cache.context import LayerContext, PaddedRows, ForwardContext, ContextLayer, row_pads
from kvcomp.codecs.base import attention_layer_types
from kvcomp.errors import ConfigError, unknown_choice
from kvcomp.kernels import KERNEL_BACKENDS, sdpa_without_cudnn
from kvcomp.kernels.decode_graphs import DecodeGraphs
from kvcomp.kernels.decode_plan import DecodePlans, DecodeWorkspace

ATTENTION_NAME = "kvcomp"
FORWARD_ARGUMENT = "kvcomp_forward"  # the decoder's keyword argument that carries the ForwardContext down to the attention modules
LAYER_ARGUMENT = "kvcomp"  # the attention module's keyword argument that carries its LayerContext


def compressed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                         kvcomp: LayerContext | None = None, **kwargs):
    """Attention of one module: with a :class:`LayerContext` (a :class:`ContextLayer` of the cache), the layer stores
    the fresh ``key``/``value`` and returns what attention reads (per row group: :class:`ByRows`); otherwise (other caches, uncompressed
    sliding-window layers) transformers' SDPA over ``key``/``value``, for single-token forwards on a GPU without
    its cuDNN kernel (:func:`~kvcomp.kernels.sdpa_without_cudnn`)."""
    def attend(query, mask, read):
        if isinstance(read, Reads):
            return read.attend(query, mask, scaling, kvcomp.forward)[0]
        with sdpa_without_cudnn() if query.is_cuda and query.shape[2] == 1 else contextlib.nullcontext():
            return sdpa_attention_forward(module, query, *read, mask, dropout, scaling, is_causal, **kwargs)[0]

    if kvcomp is None:
        return attend(query, attention_mask, (key, value)), None
    read = kvcomp.layer.update_in_context(key, value, kvcomp, query)
    if isinstance(read, ByRows):
        return read.attend(query, attention_mask, kvcomp.forward, attend), None
    return attend(query, attention_mask, read), None


def _cache_argument(kwargs: dict) -> str:
    return "cache" if "cache" in kwargs else "past_key_values"  # transformers >= 5.24 names it ``cache``


def decode_step_mask(*args, **kwargs):
    """transformers' ``sdpa_mask``, always materialised for single-token forwards that carry a padding
    mask: its test whether the mask can be skipped reads that mask on the host (``padding_mask.all()``, a
    host sync every decode step on a GPU, e.g. in ``generate``), and the fused kernels make it into one span
    of valid tokens per sequence on the device anyway (:class:`~kvcomp.kernels.valid_tokens.ValidTokens`).
    Without a padding mask the test reads no data, and longer forwards keep
    the skip (SDPA's causal kernels for prefill). ``generate`` always passes a padding mask, so its decode
    steps on the torch path run SDPA with a mask. The query length is ``q_length`` (transformers >= 5.3)
    or the length of ``cache_position`` (earlier 5.x)."""
    from transformers.masking_utils import sdpa_mask  # transformers' model stack: imported once a model runs

    positions = kwargs.get("cache_position")
    q_length = kwargs.get("q_length", None if positions is None else positions.shape[0])
    if q_length == 1 and kwargs.get("attention_mask") is not None:
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def _attention_modules(model):
    return [m for name, m in model.named_modules() if name.endswith("self_attn") and hasattr(m, "layer_idx")]


STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # inv_freq fixed for the whole sequence


class _Rotary:
    """The RoPE frequencies of one layer type, read from the model's rotary module at every use (it may
    have moved device): ``inv_freq`` and ``attention_scaling``, or ``<layer type>_inv_freq`` / ``..._scaling``
    where the module keeps one RoPE per layer type (Gemma 3: local and global bases)."""

    def __init__(self, module, prefix: str = ""):
        self.module, self.prefix = weakref.ref(module), prefix  # the model's own module: not kept alive by this

    def frequencies(self) -> tuple[torch.Tensor, float]:
        module = self.module()
        return (getattr(module, f"{self.prefix}inv_freq"), float(getattr(module, f"{self.prefix}attention_scaling", 1.0)))


def _layer_rotary(model, layer_type: str | None) -> _Rotary | None:
    """The rotary embedding of layers of ``layer_type`` when fused kernels can recompute its angles
    (``pos * inv_freq``, times ``attention_scaling``); ``None`` for RoPE types whose frequencies change with
    the sequence length (their cos/sin are kept instead)."""
    for name, module in model.named_modules():
        if not name.endswith("rotary_emb"):
            continue
        rope_type = getattr(module, "rope_type", None)
        if layer_type is not None and hasattr(module, f"{layer_type}_inv_freq"):
            kind = rope_type.get(layer_type) if isinstance(rope_type, dict) else rope_type
            return _Rotary(module, f"{layer_type}_") if kind in STATIC_ROPE_TYPES else None
        if hasattr(module, "inv_freq"):
            return _Rotary(module) if rope_type in STATIC_ROPE_TYPES else None
    return None


class Installation:
    """kvcomp's attention on one model (:func:`install`): the attention implementation and two forward pre-hooks.
    The decoder's builds each forward's :class:`ForwardContext`; each attention module's adds its :class:`LayerContext` and,
    for a :class:`ContextLayer`, takes the cache out of the module's arguments, so that the layer is updated by
    :func:`compressed_attention`, with the forward's context. ``workspace``: the fused decode kernels' scratch, kept across this
    model's steps (:class:`~kvcomp.kernels.decode_plan.DecodeWorkspace`). A context manager: leaving it removes the
    hooks and restores the installation (or attention implementation) that was there before."""

    def __init__(self, model, kernel_backend: str, previous: "Installation | None", workspace: DecodeWorkspace):
        layer_types = attention_layer_types(model.config.get_text_config(decoder=True))  # refuses unsupported kinds
        modules = _attention_modules(model)
        if not modules:
            raise NotImplementedError(f"{type(model).__name__}: no attention modules named '*self_attn' with a layer_idx")
        get_decoder = getattr(model, "get_decoder", None)
        # weak references only: the model's entry in the registry must not keep the model alive (a sweep loads one
        # model per member)
        self._model, self._decoder = weakref.ref(model), weakref.ref((get_decoder() if get_decoder else None) or model)
        self._modules = [weakref.ref(m) for m in modules]
        self.kernel_backend, self.previous, self.handles = kernel_backend, previous, []
        self.workspace = workspace  # the fused kernels' scratch (and CUDA graphs), kept across this model's steps
        self.implementation_before = previous.implementation_before if previous else model.config._attn_implementation
        by_type = {kind: _layer_rotary(model, kind) for kind in set(layer_types)}
        self.rotaries = {m.layer_idx: by_type[layer_types[m.layer_idx]] for m in modules}
        self.num_layers = len(layer_types)

    @property
    def model(self):
        return self._model()

    def attach(self) -> None:
        self.model.set_attn_implementation(ATTENTION_NAME)
        self.handles = [self._decoder().register_forward_pre_hook(self._begin_forward, with_kwargs=True)] + [
            m().register_forward_pre_hook(self._layer_context, with_kwargs=True) for m in self._modules]

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def remove(self) -> None:
        """Undo this installation (the model's latest): the previous one, if any, is back."""
        if _INSTALLED.get(self.model) is not self:
            raise RuntimeError("remove the model's latest kvcomp installation first")
        self.detach()
        if self.previous is None:
            del _INSTALLED[self.model]
            self.model.set_attn_implementation(self.implementation_before)
        else:
            _INSTALLED[self.model] = self.previous
            self.previous.attach()

    def __enter__(self) -> "Installation":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _begin_forward(self, module, args, kwargs):
        """The decoder's pre-hook: one :class:`ForwardContext` for this forward, added to its keyword arguments."""
        cache = kwargs.get(_cache_argument(kwargs))
        if cache is None or not any(isinstance(layer, ContextLayer) for layer in getattr(cache, "layers", ())):
            return None
        if len(cache.layers) != self.num_layers:
            codec = getattr(cache, "codec", None)
            built = f" (its codec {codec.name} was built for {codec.model.name})" if codec is not None else ""
            raise ConfigError(f"the cache has {len(cache.layers)} layers{built}, but this model {self.num_layers}: build "
                              "the codec for this model (kvcomp.api.load_codec(model, ...))")
        if isinstance(cache, PaddedRows) and cache.get_seq_length() == 0:
            cache.group_rows(row_pads(kwargs.get("attention_mask")))
        return args, {**kwargs, FORWARD_ARGUMENT: ForwardContext(self.kernel_backend, DecodePlans(self.workspace))}

    def _layer_context(self, module, args, kwargs):
        """An attention module's pre-hook: its :class:`LayerContext`, in place of the cache."""
        if FORWARD_ARGUMENT not in kwargs:
            return None
        forward, name = kwargs.pop(FORWARD_ARGUMENT), _cache_argument(kwargs)  # this call's own keyword dict
        cache = kwargs.get(name)
        layer = None if cache is None else cache.layers[module.layer_idx]
        if isinstance(layer, ContextLayer):
            rotary = self.rotaries[module.layer_idx]
            kwargs[name] = None  # the module skips cache.update: compressed_attention updates the layer
            kwargs[LAYER_ARGUMENT] = LayerContext(forward, layer, kwargs.get("position_embeddings"), kwargs.get("position_ids"),
                                                    None if rotary is None else rotary.frequencies)
        return args, kwargs


_INSTALLED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its latest Installation


def install(model, kernel_backend: str = "torch", cuda_graphs: bool = False) -> Installation:
    """Route ``model``'s attention through kvcomp: globally (``install(model)``) or for a block
    (``with install(model): ...``, which restores what was there before). Works with any cache; the compressed
    path switches on for caches with :class:`ContextLayer` s (:class:`~kvcomp.cache.CompressedCache`).
    ``kernel_backend="triton"``: decode steps use a codec's fused kernel where it has one; ``cuda_graphs``: each
    layer's fused decode launches are captured in a CUDA graph and replayed where they read what they read before
    (:mod:`kvcomp.kernels.decode_graphs`; verified only on a GPU). Installing again replaces the hooks (e.g. another
    backend) until that installation is removed."""
    if kernel_backend not in KERNEL_BACKENDS:
        raise unknown_choice("kernel backend", kernel_backend, KERNEL_BACKENDS)
    if cuda_graphs and kernel_backend != "triton":
        raise ConfigError("cuda_graphs=True captures the fused decode kernels: it needs kernel_backend='triton'")
    from transformers import AttentionInterface  # transformers' model stack (seconds to import): only once installed
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, compressed_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, decode_step_mask)
    previous = _INSTALLED.get(model)
    installation = Installation(model, kernel_backend, previous, DecodeWorkspace(DecodeGraphs() if cuda_graphs else None))
    if previous is not None:
        previous.detach()
    installation.attach()
    _INSTALLED[model] = installation
    return installation


def installation(model) -> Installation | None:
    """The model's latest kvcomp installation (:func:`install`), None where its attention is transformers' own."""
    return _INSTALLED.get(model)
