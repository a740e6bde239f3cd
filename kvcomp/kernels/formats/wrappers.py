"""Payloads read in split launches of their own (:func:`~kvcomp.kernels.decode_attention_triton.launch_groups`): a
payload stored in a rotated basis, less an offset, or with the sign sketch of its residual. Each wraps the reader of
what is stored and says what it adds to the launches that read it (:meth:`~kvcomp.kernels.formats.base.PayloadReader.unwrap`);
none has device functions of its own."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomp.kernels.formats.base import PayloadReader, RotaryPositions, Wrapped
from kvcomp.kernels.formats.sketch import SignReader
from kvcomp.stages.jl_sketch import estimator_scale
from kvcomp.stages.rope import apply_rope


@dataclass
class ResidualSketchReader(PayloadReader):
    """TurboQuant-prod (Algorithm 2): a payload ``inner`` plus the 1-bit QJL sketch of its residual,
    ``x = inner + sqrt(pi/2)/d ||r|| S^T sign(S r)`` (``residual``: the signs and ``||r||``; ``projection`` ``S``
    float32 ``[d, d]``). The kernel adds the sketch's score ``sqrt(pi/2)/d ||r|| <S q, sign(S r)>`` to each key's (the
    query as the model made it, projected once per step), and reads the values' sketch in launches of their own over
    the same keys, whose partial outputs, taken back by ``sqrt(pi/2)/d S``, add to the payload's (the same softmax)."""

    inner: PayloadReader
    residual: SignReader
    projection: torch.Tensor
    own_launches = True

    @property
    def kv_heads(self) -> int:
        return self.inner.kv_heads

    def unwrap(self, wrapped: Wrapped) -> PayloadReader:
        """Its sketch (this reader: its ``residual``, ``projection`` and ``basis``)."""
        wrapped.add("sketch", sketch=self)
        return self.inner

    @property
    def basis(self) -> torch.Tensor:
        """``sqrt(pi/2)/d S``: what takes the sketch's basis back to the vectors' (``x = inner + residual @ basis``)."""
        return self.projection.float() * estimator_scale(self.head_dim)

    def dequantize_unrotated(self) -> torch.Tensor:
        residual = self.residual.dequantize_unrotated()
        return self.inner.dequantize_unrotated() + residual @ self.basis.to(residual.device)


@dataclass
class RotatedReader(PayloadReader):
    """A payload stored in a rotated basis: ``x = inner @ rotation`` (``rotation`` float32 ``[D, D]``, or one per KV
    head ``[1 or H, D, D]``; e.g. vLLM's int4 per-token-head Hadamard, OSCAR's fitted rotations). The kernel reads ``inner`` as it is stored: scores as ``(q rotation^T) . inner``,
    and the attention output over the payload as ``(P inner) rotation`` (the query rotated, the output
    un-rotated, nothing decoded). Keys must be post-RoPE."""

    inner: PayloadReader
    rotation: torch.Tensor
    own_launches = True

    @property
    def kv_heads(self) -> int:
        return self.inner.kv_heads

    def unwrap(self, wrapped: Wrapped) -> PayloadReader:
        """Its rotation."""
        wrapped.add("rotation", rotation=self.rotation)
        return self.inner

    def dequantize_unrotated(self) -> torch.Tensor:
        return self.inner.dequantize_unrotated() @ self.rotation


@dataclass
class OffsetReader(PayloadReader):
    """A payload stored less an offset per KV head, ``offset`` float32 ``[H, D]`` (the ``center`` option of
    TurboQuant / EDEN / QJL): values ``x = inner + c``; keys (``rotated``) ``x = inner + R_p c``, the pre-RoPE offset
    rotated to each token's position (the step's :class:`RotaryPositions`). The kernel adds ``q . R_p c`` to each
    key's score and ``c`` to the values' share of the output (softmax weights sum to one); nothing is decoded."""

    inner: PayloadReader
    offset: torch.Tensor
    rotated: bool
    own_launches = True

    @property
    def kv_heads(self) -> int:
        return self.inner.kv_heads

    def unwrap(self, wrapped: Wrapped) -> PayloadReader:
        """Its offset, and whether it is rotated to each token's position."""
        wrapped.add("offset", offset=self.offset, offset_rotated=self.rotated)
        return self.inner

    def dequantize(self, rope: RotaryPositions | None = None) -> torch.Tensor:
        x = self.inner.dequantize()
        b, h, t, d = x.shape
        offset = self.offset.float().to(x.device)[None, :, None, :].expand(b, h, t, d)
        if self.rotated:
            if rope is None:
                raise ValueError("a rotated key offset needs the keys' positions (key_rope)")
            offset = apply_rope(offset, *rope.cos_sin(t))
        return x + offset
