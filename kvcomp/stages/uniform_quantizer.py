"""Asymmetric min-max integer quantization in groups: the quantizer of uniform and KIVI.

For a group ``x_g`` and ``b`` bits (KIVI, Liu et al. 2024, Eq. 1):
``z = min(x_g)``, ``s = (max(x_g) - z) / (2^b - 1)``, ``q = clamp(round((x - z) / s), 0, 2^b - 1)``,
``x_hat = q * s + z``.

Two group shapes over a ``[batch, heads, tokens, head_dim]`` block:

- ``per_token``: groups of ``group_size`` adjacent channels of one token (KIVI's values);
- ``per_channel``: groups of ``group_size`` adjacent tokens of one channel (KIVI's keys).

Scale and zero-point are computed in float32 and stored in ``param_dtype`` (16 bits, as the papers
count them); the codes are computed with the stored, rounded parameters, so encode and decode agree
exactly. A block whose parameters do not fit ``param_dtype`` (float16 beyond 65504, e.g. inputs of
magnitude 1e5) stores that block's scale and zero in float32 instead: the cache's measured bytes grow
accordingly (consecutive blocks concatenate to float32), while ``bits_per_value`` stays the nominal
16-bit count. Inputs whose group range ``max - min`` overflows even float32 (the top code would decode
to Inf) raise :class:`NonFiniteKVError`. Given a ``range_checks`` list (a cache with ``check_finite="deferred"``,
:mod:`kvcomp.stages.ranges`) the parameters are always stored in ``param_dtype`` and whether they fit is
left on the device for the cache to read one forward later (no host sync per encode). Codes are packed
along the channel axis of each token, so every stored tensor has tokens (or token groups) on dim 2
and payloads of consecutive blocks concatenate along that dim.
"""

import math
from dataclasses import dataclass

import torch

from kvcomp.errors import ConfigError, NonFiniteKVError
from kvcomp.stages.packing import pack_bits, packed_length, unpack_bits
from kvcomp.stages.ranges import range_fits, saturated

AXES = ("per_token", "per_channel")


@dataclass(frozen=True)
class GroupQuantizer:
    """Quantize ``[B, H, T, D]`` blocks with ``bits`` bits in groups along ``axis``."""

    bits: int
    group_size: int
    axis: str
    param_dtype: torch.dtype = torch.float16

    def validate(self, head_dim: int, owner: str) -> None:
        """Raise :class:`ConfigError` naming ``owner`` when this quantizer cannot code ``head_dim`` channels."""
        if not isinstance(self.bits, int) or not 1 <= self.bits <= 8:
            raise ConfigError(f"{owner}: bits={self.bits!r} is not supported; choose an integer in 1..8")
        if self.axis not in AXES:
            raise ConfigError(f"{owner}: axis {self.axis!r} is unknown; valid choices: {', '.join(AXES)}")
        if self.group_size < 1:
            raise ConfigError(f"{owner}: group_size must be positive, got {self.group_size}")
        if self.axis == "per_token" and head_dim % self.group_size:
            divisors = [g for g in range(1, head_dim + 1) if head_dim % g == 0]
            raise ConfigError(
                f"{owner}: per_token group_size={self.group_size} does not divide head_dim={head_dim}; "
                f"valid group sizes: {divisors}"
            )

    @property
    def block_multiple(self) -> int:
        """Encoded blocks must hold a multiple of this many tokens."""
        return self.group_size if self.axis == "per_channel" else 1

    def bits_per_value(self, head_dim: int) -> float:
        """Exact stored bits per value: packed codes + 16-bit scale and zero per group."""
        code_bits = 8 * packed_length(head_dim, self.bits) / head_dim
        param_bits = 2 * torch.finfo(self.param_dtype).bits / self.group_size
        return code_bits + param_bits

    def encode(self, x: torch.Tensor, range_checks: list | None = None) -> dict[str, torch.Tensor]:
        """``x [B, H, T, D]`` -> ``{"codes": uint8 [B,H,T,packed], "scale", "zero"}`` (``range_checks``:
        :mod:`kvcomp.stages.ranges`)."""
        b, h, t, d = x.shape
        if self.axis == "per_token":
            groups = x.float().reshape(b, h, t, d // self.group_size, self.group_size)
            lo, hi = groups.amin(-1), groups.amax(-1)  # [B,H,T,D/G]
        else:
            groups = x.float().reshape(b, h, t // self.group_size, self.group_size, d)
            lo, hi = groups.amin(-2), groups.amax(-2)  # [B,H,T/G,D]
        levels = (1 << self.bits) - 1
        scale, zero = self._stored((hi - lo) / levels, lo, hi, levels, range_checks)
        s, z = self._expand(scale), self._expand(zero)
        q = torch.round((x.float() - z) / s.clamp_min(torch.finfo(torch.float32).tiny)).clamp_(0, levels)
        return {"codes": pack_bits(q.to(torch.uint8), self.bits), "scale": scale, "zero": zero}

    def _stored(
        self, scale: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, levels: int, range_checks: list | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero as stored: in ``param_dtype`` when the top code of every group then decodes to a
        finite value (``levels * s + z``, as :meth:`decode` and the fused kernel compute it), else in
        float32; raise :class:`NonFiniteKVError` when not even float32 holds the range. With a ``range_checks``
        list: always ``param_dtype``, whether it fits appended to the list."""
        if range_checks is not None:
            s, z = scale.to(self.param_dtype), lo.to(self.param_dtype)
            range_fits(torch.isfinite(levels * s.float() + z.float()).all(), range_checks)
            return s, z
        for dtype in (self.param_dtype, torch.float32):
            s, z = scale.to(dtype), lo.to(dtype)
            if torch.isfinite(levels * s.float() + z.float()).all():  # also false for Inf/NaN s or z
                return s, z
        peak = torch.maximum(lo.abs(), hi.abs()).max().item()
        if not math.isfinite(peak):
            raise NonFiniteKVError("uniform quantizer: the input holds NaN or Inf")
        raise NonFiniteKVError(
            f"uniform quantizer: a group's range (max - min) overflows float32 "
            f"(largest input magnitude {peak:.3g}, float32 max {torch.finfo(torch.float32).max:.3g}); "
            "inputs this large cannot be quantized"
        )

    def decode(self, payload: dict[str, torch.Tensor], head_dim: int, dtype: torch.dtype) -> torch.Tensor:
        """Inverse of :meth:`encode`: ``x_hat = code * scale + zero`` as ``[B, H, T, D]`` in ``dtype``."""
        codes = unpack_bits(payload["codes"], self.bits, head_dim, torch.float32)
        b, h, t, d = codes.shape
        scale, zero = payload["scale"].float(), payload["zero"].float()
        if self.axis == "per_token":  # each group's parameters broadcast over its channels (no expanded copy)
            x = codes.view(b, h, t, d // self.group_size, self.group_size) * scale[..., None] + zero[..., None]
        else:  # ... over its tokens
            x = codes.view(b, h, t // self.group_size, self.group_size, d) * scale[..., None, :] + zero[..., None, :]
        return saturated(x.view(b, h, t, d), dtype)

    def _expand(self, param: torch.Tensor) -> torch.Tensor:
        """Broadcast a per-group parameter to ``[B, H, T, D]`` (float32)."""
        return param.float().repeat_interleave(self.group_size, dim=-1 if self.axis == "per_token" else -2)
