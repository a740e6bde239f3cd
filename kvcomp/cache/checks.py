"""Checks of what one cache layer is given: K/V of the shape its codec was built for (:func:`check_kv_shape`), and
finiteness (:class:`~kvcomp.cache.CompressedCache`'s ``check_finite``): NaN/Inf in the K/V a forward brings, and in
what the layer's codec decoded from them."""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import torch

from kvcomp.errors import ConfigError, NonFiniteKVError

CHECK_FINITE = (True, False, "deferred")
T = TypeVar("T")


def finite(*tensors: torch.Tensor) -> torch.Tensor:
    """Device bool: no NaN/Inf in ``tensors`` (summed in float64, which no sum of finite float32, bfloat16 or
    float16 values overflows)."""
    return torch.isfinite(sum(t.sum(dtype=torch.float64) for t in tensors))


def check_kv_shape(codec, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """Refuse keys and values of another shape than ``codec`` was built for (at a layer's first forward)."""
    model = codec.model
    for kind, x in (("keys", key_states), ("values", value_states)):
        if x.dim() != 4 or (x.shape[1], x.shape[3]) != (model.num_kv_heads, model.head_dim):
            raise ConfigError(f"codec {codec.name} was built for {model.name}, whose layer {layer_idx} has "
                              f"{model.num_kv_heads} KV heads of size {model.head_dim}, but this model's {kind} are "
                              f"{tuple(x.shape)} [batch, heads, tokens, head_dim]: build the codec for this model "
                              "(kvcomp.api.load_codec(model, ...))")


def _span(first: int, count: int) -> str:
    return f"{first}..{first + count - 1}"


class DeviceFlag:
    """Device bools read later without stalling the stream: on a GPU they are copied into pinned host memory
    behind an event, and reading waits for that event only (not for work queued after it)."""

    def __init__(self, flag: torch.Tensor):
        self.event = None
        if flag.device.type == "cuda":
            self.host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
            self.host.copy_(flag, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = flag

    def read(self) -> list[bool]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.reshape(-1).tolist()


class FiniteChecks:
    """``mode=True``: NaN/Inf in incoming K/V raise :class:`NonFiniteKVError` at once (a host sync per layer on a
    GPU), and so do NaN/Inf in the blocks the layer's codec decoded in that forward (one more sync, only in the
    forwards that decode new blocks); ``"deferred"``: these verdicts, and whether the codecs' 16-bit scales and norms
    held their values (:mod:`kvcomp.stages.ranges`), stay on the device and are read one forward later (no sync);
    ``False``: never checked.

    The decoded blocks checked are the new entries of each stream's decoded copy; reads of the payloads where they
    are stored (a fused kernel's, the torch path's tiles) and ``decode_per_step`` reads keep no decoded copy and are
    not checked."""

    def __init__(self, mode: bool | str, layer_idx: int):
        if mode not in CHECK_FINITE:
            raise ConfigError(f"unknown check_finite {mode!r}; valid choices: True, False, 'deferred'")
        self.mode, self.layer_idx = mode, layer_idx
        # deferred: verdicts, first position, count, kinds of the decoded streams checked, codec
        self.pending: tuple[DeviceFlag, int, int, tuple[str, ...], str] | None = None
        self.checked: list[tuple[object, int, int]] = []  # per stream: (its decoded copy, generation, entries checked)

    def reset(self) -> None:
        """Forget the last forward (the cache was reset)."""
        self.pending, self.checked = None, []

    def around(self, key_states: torch.Tensor, value_states: torch.Tensor, first: int,
               store: Callable[[list | None], T], streams: Callable[[], Sequence]) -> T:
        """``store(range_checks)`` (which stores the forward's K/V from cache position ``first`` on into ``streams()``,
        the layer's :class:`~kvcomp.cache.stream.KVStream` s, read after the store: a press may rebuild them), checked
        by the mode. ``range_checks`` is what its encodes' requests carry (:mod:`kvcomp.stages.ranges`): a list the
        mode ``"deferred"`` reads one forward later, else None (checked on the host)."""
        if not self.mode:
            return store(None)
        if self.mode is True:
            self._check_incoming(key_states, value_states, first)
            out = self._stored(store, None, streams)
            decoded = self._newly_decoded(streams())
            if decoded and not finite(*(x for _, x in decoded)):
                bad = {kind: x for kind, x in decoded if not finite(x)}
                raise self._decoded_error(streams()[0].codec.name, bad, first, key_states.shape[2])
            return out
        self.raise_pending()  # the previous forward's verdicts, long computed
        ranges = []
        out = self._stored(store, ranges, streams)
        decoded = self._newly_decoded(streams())
        verdicts = [finite(key_states, value_states), *ranges, *(finite(x) for _, x in decoded)]
        self.pending = (DeviceFlag(torch.stack(verdicts)), first, key_states.shape[2], tuple(kind for kind, _ in decoded),
                        streams()[0].codec.name)
        return out

    def _stored(self, store: Callable[[list | None], T], range_checks: list | None, streams: Callable[[], Sequence]) -> T:
        """``store(range_checks)``; a codec's own refusal of values it cannot store (:class:`NonFiniteKVError`) names
        the layer and the codec."""
        try:
            return store(range_checks)
        except NonFiniteKVError as error:
            raise NonFiniteKVError(f"layer {self.layer_idx}, codec {streams()[0].codec.name}: {error}") from error

    def _newly_decoded(self, streams: Sequence) -> list[tuple[str, torch.Tensor]]:
        """``(stream kind, entries its decoded copy gained since the last check)`` of each stream that gained some
        (the streams of every row group, in order); a copy rewritten in place since (a press's
        :meth:`~kvcomp.cache.growing.GrowingTensor.keep`) is checked whole again."""
        fresh, checked = [], []
        for i, stream in enumerate(streams):
            copy = stream.decoded.tensor
            seen, generation, count = self.checked[i] if i < len(self.checked) else (None, 0, 0)
            start = count if seen is copy and generation == copy.generation else 0
            checked.append((copy, copy.generation, copy.length))
            if copy.length > start:
                fresh.append((stream.kind, copy.view.narrow(2, start, copy.length - start)))
        self.checked = checked
        return fresh

    def _check_incoming(self, key_states: torch.Tensor, value_states: torch.Tensor, first: int) -> None:
        if not finite(key_states, value_states):
            kind = "keys" if not torch.isfinite(key_states).all() else "values"
            raise NonFiniteKVError(f"layer {self.layer_idx}: NaN or Inf in incoming {kind} "
                                   f"(cache positions {_span(first, key_states.shape[2])})")

    def _decoded_error(self, codec: str, decoded: dict, first: int, count: int, late: str = "") -> NonFiniteKVError:
        kinds = " and ".join(f"{kind}s" for kind in decoded)
        return NonFiniteKVError(
            f"layer {self.layer_idx}: codec {codec} decoded NaN or Inf {kinds} from finite input (blocks encoded by "
            f"the forward of cache positions {_span(first, count)} or before{late}): the values are beyond what "
            f"{codec} can store; scale the model's K/V down or use another codec")

    def raise_pending(self) -> None:
        """Read the verdicts of the last forward under ``"deferred"``: NaN/Inf in the incoming K/V and in the
        blocks the codec decoded, and scales or norms that overflowed their 16-bit storage dtype. They were copied to the host without waiting, so reading them one forward later costs no sync."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        flag, first, count, kinds, codec = pending
        verdicts, positions = flag.read(), _span(first, count)
        if not verdicts[0]:
            raise NonFiniteKVError(f"layer {self.layer_idx}: NaN or Inf in the keys or values of an earlier forward "
                                   f"(cache positions {positions}; check_finite='deferred' reports it one forward late)")
        ranges = verdicts[1:len(verdicts) - len(kinds)]
        if not all(ranges):
            raise NonFiniteKVError(
                f"layer {self.layer_idx}, codec {codec}: a scale or norm overflowed its storage dtype (cache positions "
                f"{positions}; reported one forward late by check_finite='deferred'): set codec.param_dtype=float32 (QJL's "
                "norms: codec.norm_dtype=float32; HIGGS, AQUA-KV: codec.scale_dtype=float32), or use check_finite=True "
                "(the field then falls back to float32 per block where it must)")
        bad = [kind for kind, ok in zip(kinds, verdicts[len(verdicts) - len(kinds):]) if not ok]
        if bad:
            raise self._decoded_error(codec, dict.fromkeys(bad), first, count, "; reported one forward late by "
                                      "check_finite='deferred'")
