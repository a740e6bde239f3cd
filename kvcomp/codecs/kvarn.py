"""KVarN (Muller et al. 2026, arXiv 2606.03458): Hadamard rotation, Sinkhorn variance normalisation of each tile of
``tile`` tokens, asymmetric round-to-nearest; keys per channel, values per token (K4V2, tile 128 by default).

As the authors' vLLM backend (huawei-csl/KVarN: ``kvarn/config.py``, ``kvarn/sinkhorn.py``, ``ops/kvarn_store.py``,
``ops/kvarn_decode.py``) stores one head's tile of ``G = tile`` tokens and ``D = head_dim`` channels:

1. Rotation: ``X H / sqrt(D)`` with ``H`` the Sylvester Hadamard matrix along ``head_dim`` (not randomised), keys
   after RoPE (the backend receives post-RoPE keys); ``H / sqrt(D)`` is its own inverse.
2. Variance normalisation (:func:`~kvcomp.stages.sinkhorn.variance_normalize`, ``sinkhorn_iters`` rounds, the
   reference's 16): keys as the ``[D, G]`` matrix (rows channels), values as ``[G, D]`` (rows tokens), so that
   ``X = s_row * B * s_col``.
3. RTN per row of ``B`` (keys: each channel over the tile's ``G`` tokens; values: each token over its ``D``
   channels): ``z = min``, ``s = max((max - min) / (2^b - 1), 1e-10)``, ``q = clamp(round((B - z) / s), 0, 2^b - 1)``,
   the codes computed with these float32 parameters as the reference does.
4. The row's RTN scale and zero are absorbed into its Sinkhorn scale and stored in ``param_dtype`` (float16):
   keys ``x[d, t] = (q * a_d + c_d) * u_t`` with ``a = s_row s``, ``c = s_row z`` per channel and ``u = s_col``
   per token; values ``x[t, d] = (q * a_t + c_t) * w_d`` with ``a, c`` per token and ``w = s_col`` per channel.

Stored bits per value (``p`` = 16): keys ``b + p (2 D + G) / (D G)``, values ``b + p (D + 2 G) / (D G)``: for
``D = G = 128``, 4.375 and 2.375 (``KVarNConfig.k_scale_bytes`` / ``v_scale_bytes`` of the reference).

Schedule (:class:`StreamPolicy`): one tile is one block, ``block_size = tile``, encoded once it is full, the
in-progress tile in full precision (``window = 0``; vLLM's "tail"), and the first ``sinks = 128`` tokens (the
request's first block, kept in fp16 "forever" by the backend's sink/tail pool) never encoded. That fp16 pool is
the only full-precision store: there is no outlier pool (outlier channels are spread by the Hadamard rotation,
outlier token scales absorbed by the normalisation).

With ``kernel_backend=triton`` decode steps read the packed codes, their parameters and normalisers in the fused
decode-attention kernel in the rotated basis (the query rotated, the output un-rotated), nothing decoded.

Differences from the reference: the codes are packed along the channels of each token for keys too (the reference
packs keys along the tile's tokens: the same bytes); a field beyond float16 keeps that block in float32
(:func:`~kvcomp.stages.ranges.stored_in`); inputs whose rotation overflows float32 are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcomp.codecs.base import Codec, CodecConfig, FusedPayload, Payload, StreamPolicy, StreamRequest
from kvcomp.codecs.registry import register
from kvcomp.codecs.uniform import PARAM_DTYPES
from kvcomp.errors import ConfigError, NonFiniteKVError, unknown_choice
from kvcomp.kernels.formats import RotatedReader, UniformReader
from kvcomp.stages.hadamard import fwht, is_power_of_two
from kvcomp.stages.packing import pack_bits, packed_length, unpack_bits
from kvcomp.stages.ranges import range_fits, saturated, stored_in
from kvcomp.stages.sinkhorn import variance_normalize

MIN_STEP = 1e-10  # the reference's floor of the RTN step


@dataclass
class KVarNConfig(CodecConfig):
    name: str = "kvarn"
    key_bits: int = 4  # the released preset kvarn_k4v2_g128
    value_bits: int = 2
    tile: int = 128  # tokens per normalisation tile ("g128"; the vLLM block size)
    sinkhorn_iters: int = 16  # the reference sinkhorn.py and Ascend kernel; the later vLLM config runs 8
    sinks: int = 128  # first tokens kept in full precision (the backend's sink block)
    param_dtype: str = "float16"  # storage of the absorbed scales, zeros and normalisers


@register
class KVarNCodec(Codec, FusedPayload):
    """Hadamard + Sinkhorn-normalised asymmetric RTN per tile; keys per channel, values per token; the fused decode
    kernel reads the packed codes and their parameters in the rotated basis."""

    config_class = KVarNConfig

    def validate(self) -> None:
        cfg, d = self.config, self.model.head_dim
        for field in ("key_bits", "value_bits"):
            bits = getattr(cfg, field)
            if not isinstance(bits, int) or not 1 <= bits <= 8:
                raise ConfigError(f"{self.name}: {field}={bits!r} is not supported; choose an integer in 1..8")
        if cfg.tile < 2:
            raise ConfigError(f"{self.name}: tile={cfg.tile} must be >= 2 tokens (the normalisation takes stds "
                              "over it)")
        if cfg.sinkhorn_iters < 0 or cfg.sinks < 0:
            raise ConfigError(f"{self.name}: sinkhorn_iters and sinks must be >= 0, got {cfg.sinkhorn_iters} "
                              f"and {cfg.sinks}")
        if cfg.param_dtype not in PARAM_DTYPES:
            raise unknown_choice(f"{self.name} param_dtype", cfg.param_dtype, PARAM_DTYPES)
        if d < 2 or not is_power_of_two(d):
            raise ConfigError(f"{self.name}: head_dim={d} of {self.model.name} must be a power of two >= 2 "
                              "(the Hadamard rotation along head_dim)")

    def build(self) -> None:
        self.rotations: dict = {}  # device -> H / sqrt(D) as a matrix, for the fused kernel

    def bits(self, kind: str) -> int:
        return self.config.key_bits if kind == "key" else self.config.value_bits

    def policy(self, kind: str, layer_idx: int) -> StreamPolicy:
        return StreamPolicy(sinks=self.config.sinks, block_size=self.config.tile, window=0)

    def code_bits_per_value(self, kind: str, layer_idx: int) -> float:
        d, g = self.model.head_dim, self.config.tile
        p = torch.finfo(PARAM_DTYPES[self.config.param_dtype]).bits
        per_tile = 2 * d + g if kind == "key" else d + 2 * g  # keys: a, c per channel, u per token; values: converse
        return 8 * packed_length(d, self.bits(kind)) / d + p * per_tile / (d * g)

    def payload_reader(self, payload: Payload, kind: str, layer_idx: int) -> RotatedReader:
        """The tile in the rotated basis as packed ints with a multiplier (step 4): keys ``(q a_d + c_d) u_t`` (per
        channel every ``tile`` tokens, times a per-token factor), values ``(q a_t + c_t) w_d`` (per token, times a
        per-channel factor every ``tile`` tokens); ``x = tile @ (H / sqrt(D))``."""
        p, d, n = payload.tensors, self.model.head_dim, payload.num_tokens
        if kind == "key":
            inner = UniformReader(n, d, p["codes"], p["chan_scale"], p["chan_zero"], self.bits(kind), self.config.tile,
                                  True, p["token_scale"])
        else:
            inner = UniformReader(n, d, p["codes"], p["token_scale"][..., None], p["token_zero"][..., None],
                                  self.bits(kind), d, False, p["chan_scale"], self.config.tile)
        device = p["codes"].device
        if device not in self.rotations:
            self.rotations[device] = self._rotate(torch.eye(d, device=device))
        return RotatedReader(n, d, inner, self.rotations[device])

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x H / sqrt(D)`` (float32): the rotation and its inverse."""
        return fwht(x.float() / math.sqrt(x.shape[-1]))

    def encode(self, request: StreamRequest) -> Payload:
        b, h, t, d = request.tokens.shape
        g, bits = self.config.tile, self.bits(request.kind)
        rotated, checks = self._rotate(request.tokens), request.range_checks
        if not range_fits(torch.isfinite(rotated).all(), checks):
            raise NonFiniteKVError(f"the Hadamard rotation of the {request.kind}s overflows float32 "
                                   f"(largest input magnitude {request.tokens.abs().max().item():.3g})")
        tiles = rotated.view(b, h, t // g, g, d)
        keys = request.kind == "key"
        balanced, s_col, s_row = variance_normalize(tiles.transpose(-1, -2) if keys else tiles,
                                                    self.config.sinkhorn_iters)
        lo, hi = balanced.amin(-1, keepdim=True), balanced.amax(-1, keepdim=True)  # per row
        levels = (1 << bits) - 1
        step = ((hi - lo) / levels).clamp_min(MIN_STEP)
        q = torch.round((balanced - lo) / step).clamp_(0, levels).to(torch.uint8)
        dtype = PARAM_DTYPES[self.config.param_dtype]
        row_scale = stored_in(s_row * step, dtype, checks).squeeze(-1)
        row_zero = stored_in(s_row * lo, dtype, checks).squeeze(-1)
        col_scale = stored_in(s_col, dtype, checks).squeeze(-2)
        if keys:  # rows are channels [.., D], columns tokens [.., G]
            q = q.transpose(-1, -2)
            tensors = {"chan_scale": row_scale, "chan_zero": row_zero, "token_scale": col_scale.reshape(b, h, t)}
        else:  # rows are tokens, columns channels
            tensors = {"token_scale": row_scale.reshape(b, h, t), "token_zero": row_zero.reshape(b, h, t),
                       "chan_scale": col_scale}
        return Payload({"codes": pack_bits(q.reshape(b, h, t, d), bits), **tensors}, t)

    def decode(self, payload: Payload, request: StreamRequest) -> torch.Tensor:
        p, d, g = payload.tensors, self.model.head_dim, self.config.tile
        codes = unpack_bits(p["codes"], self.bits(request.kind), d).float()
        b, h, t, _ = codes.shape
        q = codes.view(b, h, t // g, g, d)
        chan = p["chan_scale"].float().unsqueeze(-2)  # [B, H, T/G, 1, D]
        token = p["token_scale"].float().view(b, h, t // g, g, 1)
        if request.kind == "key":
            tiles = (q * chan + p["chan_zero"].float().unsqueeze(-2)) * token
        else:
            tiles = (q * token + p["token_zero"].float().view(b, h, t // g, g, 1)) * chan
        return saturated(self._rotate(tiles.reshape(b, h, t, d)), request.dtype)
