"""A transformers 5.x ``Cache`` whose layers hold codec payloads instead of full K/V tensors."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from kvcomp.cache.accounting import ByteAccounting
from kvcomp.cache.checks import CHECK_FINITE, FiniteChecks
from kvcomp.cache.eviction import check_press
from kvcomp.cache.layer import CompressedLayer, LayerPart
from kvcomp.cache.positions import Positions
from kvcomp.cache.rows import RowGroup, padding_groups
from kvcomp.cache.scopes import Scope, make_scope
from kvcomp.cache.context import PaddedRows
from kvcomp.codecs.base import FULL, Codec
from kvcomp.errors import ConfigError
from kvcomp.presses import Press

PROTOCOLS = ("streaming", "simulated", "exact_prefill")


def _row_index(indices: torch.Tensor) -> torch.Tensor:
    """Batch rows to keep, from transformers' indices or boolean mask."""
    return indices.nonzero().squeeze(-1) if indices.dtype == torch.bool else indices


class CompressedCache(Cache, PaddedRows, ByteAccounting):
    """KV cache compressed by ``codec``.

    ``protocol``: how a multi-token forward (prefill) sees the tokens it brings in:
    ``streaming``: as a token-by-token feed would (blocks encoded within the forward are seen encoded
    by the queries after the token that completed them; see :mod:`kvcomp.cache.reads`);
    ``simulated``: encoded, by every query (the seeds' protocol); ``exact_prefill``: uncompressed (a
    deployed prefill: attention runs on the fresh K/V, the cache stores them encoded for later
    forwards). Earlier tokens are always seen as stored.
    Decode steps on the torch path read the payloads tile by tile where the codec has a payload reader
    (:class:`~kvcomp.codecs.base.FusedPayload`; :mod:`kvcomp.cache.tiles`): no decoded copy is kept, and a
    tile is the only working memory. ``decoded_copy=True`` reads them from a decoded copy of the blocks instead (each
    block decoded once and kept, working memory :attr:`working_nbytes`), as every other read does: multi-token
    forwards, and codecs without a payload reader. ``decode_per_step=True``: those reads keep no decoded copy and
    decode every block at every read (memory-true, slower).
    ``compress_generated=False`` encodes the first forward's tokens only and keeps every later
    (generated) token in full precision. ``check_finite``: NaN/Inf in incoming K/V raise
    :class:`~kvcomp.errors.NonFiniteKVError` at once (``True``: a host sync per layer on a GPU), one
    forward later without any sync (``"deferred"``, which also defers the checks that uniform/KIVI's and HIGGS'
    scales fit their dtype, an error then instead of uniform's float32 fallback; :meth:`raise_if_nonfinite` reads the
    last ones), or never (``False``). ``capacity``: the tokens per sequence (prompt, padding and generated
    tokens) to preallocate storage for, e.g. ``prompt + max_new_tokens``: every buffer is reserved at its
    first append (payloads for ``capacity`` tokens, the full-precision tail as two small buffers it moves
    between, position ids), so decode steps within it allocate no storage (the tail alternates between
    its two buffers); the reservation beyond what is held counts as :attr:`working_nbytes`. Beyond ``capacity``
    the buffers grow as without it (``None``: grow as needed).

    Scheduling follows the codec's scope (:mod:`kvcomp.cache.scopes`): stream- and layer-scope blocks are
    encoded in the layer's update (a layer-scope encode receives the previous layer's reconstruction
    of the same block, handed over by that layer); model-scope blocks once the last layer has appended
    them, after its attention, so the forward that completes a block sees it in full precision under
    every protocol. Bytes are reported apart (:mod:`kvcomp.cache.accounting`): :attr:`full_precision_nbytes`,
    :attr:`payload_nbytes`, :attr:`state_nbytes` (their sum is :attr:`nbytes`), :attr:`bookkeeping_nbytes`,
    :attr:`working_nbytes`.

    Rows left-padded unevenly (a batch of prompts of several lengths) are grouped by their padding before the
    first forward (:meth:`group_rows`, :mod:`kvcomp.cache.rows`): each group has its own streams and scope and holds
    no pad token, so a row is compressed (and its bytes counted) as when it runs alone.

    Models with sliding-window layers (``codec.model.layer_types``): the layers the codec encodes
    (:attr:`compressed_layers`; see :meth:`~kvcomp.codecs.base.ModelInfo.encoding`) are
    :class:`CompressedLayer` s, the others transformers' uncompressed ``DynamicSlidingWindowLayer``
    (:attr:`window_layers`, the last ``sliding_window - 1`` tokens); every byte count includes both.
    """

    def __init__(self, codec: Codec, protocol: str = "streaming", check_finite: bool | str = True,
                 compress_generated: bool = True, decode_per_step: bool = False, capacity: int | None = None,
                 press: Press | None = None, decoded_copy: bool = False):
        if protocol not in PROTOCOLS:
            raise ConfigError(f"unknown protocol {protocol!r}; valid choices: {', '.join(PROTOCOLS)}")
        check_press(press, codec, protocol, compress_generated)
        if check_finite not in CHECK_FINITE:
            raise ConfigError(f"unknown check_finite {check_finite!r}; valid choices: True, False, 'deferred'")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ConfigError(f"capacity={capacity!r}: a positive number of tokens per sequence, or None (grow as needed)")
        if decoded_copy and decode_per_step:
            raise ConfigError("decoded_copy=True keeps the decoded blocks, decode_per_step=True decodes them at every "
                              "read: choose one")
        self.codec, self.protocol, self.press = codec, protocol, press
        self.capacity, self.decode_per_step = capacity or 0, decode_per_step
        self.groups = [RowGroup(None, 0, make_scope(codec, self.capacity, decode_per_step))]
        info = codec.model
        encoded = dict(zip(info.model_layers, range(info.num_layers)))  # model layer -> codec layer
        layers = []
        for i in range(info.total_layers):
            if i not in encoded:  # a sliding-window layer the codec leaves alone: transformers' bounded window
                layers.append(DynamicSlidingWindowLayer(info.sliding_window))
                continue
            layers.append(CompressedLayer(self._parts(encoded[i]), protocol, FiniteChecks(check_finite, encoded[i]),
                                          compress_generated, press, tiles=not decoded_copy))
        super().__init__(layers=layers)
        self.compressed_layers = [layer for layer in layers if isinstance(layer, CompressedLayer)]
        self.window_layers = [layer for layer in layers if not isinstance(layer, CompressedLayer)]

    def _parts(self, layer_idx: int) -> list[LayerPart]:
        """Codec layer ``layer_idx``'s part of every row group (made in layer order: scopes chain their layers)."""
        parts = []
        for group in self.groups:
            positions = Positions(self.capacity)
            parts.append(LayerPart(group, group.scope.schedule(layer_idx, positions.rope), positions))
        return parts

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' entry without kvcomp's attention; refuses a model with more layers than the codec's."""
        if layer_idx >= len(self.layers):
            raise ConfigError(f"the cache has {len(self.layers)} layers (its codec {self.codec.name} was built for "
                              f"{self.codec.model.name}), but this model has a layer {layer_idx}: build the codec for "
                              "this model (kvcomp.api.load_codec(model, ...))")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def group_rows(self, pads: list[int]) -> None:
        """Give each set of rows with the same left padding its own streams and scope (:mod:`kvcomp.cache.rows`),
        before the first forward: a row is then compressed as when it runs alone."""
        spec = padding_groups(pads)
        if [(g.rows, g.pads) for g in self.groups] == spec:
            return
        if self.get_seq_length():
            raise RuntimeError("rows are grouped by their padding before the first forward only")
        self.groups = [RowGroup(rows, p, make_scope(self.codec, self.capacity, self.decode_per_step)) for rows, p in spec]
        for layer in self.compressed_layers:
            layer.parts = self._parts(layer.layer_idx)

    @property
    def scope(self) -> Scope:
        """The scheduling of a cache whose rows are not grouped by padding (see :attr:`groups`)."""
        if len(self.groups) > 1:
            raise NotImplementedError("this cache's rows are grouped by their left padding: each group has its own scope")
        return self.groups[0].scope

    def raise_if_nonfinite(self) -> None:
        """Read every layer's pending ``check_finite="deferred"`` verdict (e.g. after the last forward)."""
        for layer in self.compressed_layers:
            layer.raise_if_nonfinite()

    def layer_types(self) -> dict[str, list]:
        """The cache's layers by attention type (``full_attention``, ``sliding_attention``), model order."""
        kinds = self.codec.model.layer_types or (FULL,) * len(self.layers)
        return {kind: [layer for layer, k in zip(self.layers, kinds) if k == kind] for kind in dict.fromkeys(kinds)}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.select_rows(torch.arange(self.compressed_layers[0].batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows(_row_index(indices))

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (row ``r`` becomes old row ``index[r]``: beam reorder, batch select / repeat)
        of everything held; grouped rows stay with their group (one host read of ``index``)."""
        for layer in self.window_layers:
            layer.reorder_cache(index)
        if len(self.groups) == 1 and self.groups[0].rows is None:
            picks = [(0, index, None)]
        else:
            old = index.tolist()
            owner = {row: (k, pos) for k, g in enumerate(self.groups) for pos, row in enumerate(g.rows)}
            picks = []
            for k in range(len(self.groups)):
                rows = [r for r, o in enumerate(old) if owner[o][0] == k]
                if rows:
                    picks.append((k, torch.tensor([owner[old[r]][1] for r in rows]), rows))
        for k, local, rows in picks:
            self.groups[k].scope.select_rows(local)
            self.groups[k].move(rows)
            for layer in self.compressed_layers:
                layer.parts[k].select_rows(local)
        self.groups = [self.groups[k] for k, _, _ in picks]
        for layer in self.compressed_layers:
            layer.parts = [layer.parts[k] for k, _, _ in picks]
