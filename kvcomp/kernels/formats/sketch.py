"""Sign bits: QJL's sign-sketched keys (scored from their bits, Eq. 4 of the paper plus the outlier term) and sign
bits times a norm read as values (TurboQuant-prod's residual sketch). Device functions:
:mod:`kvcomp.kernels.formats.sketch_triton`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvcomp.kernels.formats.base import CallQuery, PayloadReader, Strided, four_programs, unrotated
from kvcomp.stages.jl_sketch import channel_mask, estimator_scale, unpack_signs


@dataclass
class SketchedKeys:
    """Encoded keys of one layer, ``T`` tokens per (batch, KV head); ``T`` a multiple of ``group_size``.

    ``signs`` uint8 ``[B, H, T, m/8]`` and ``inlier_norm`` ``[B, H, T]`` code the inlier part; with
    outliers, ``outlier_signs`` uint8 ``[B, H, T, m_o/8]`` (sketched by the first ``m_o`` rows of
    ``projection``), ``outlier_norm`` ``[B, H, T]`` and ``outlier_channels`` ``[B, H, T/G, n_out]``.
    """

    signs: torch.Tensor
    inlier_norm: torch.Tensor
    projection: torch.Tensor  # [m, D] float32
    group_size: int
    outlier_signs: torch.Tensor | None = None
    outlier_norm: torch.Tensor | None = None
    outlier_channels: torch.Tensor | None = None
    projection_columns: tuple | None = None  # columns_of(projection), kept by the codec; else made per call

    def columns(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`columns_of` the projection, on ``device``."""
        if self.projection_columns is not None:
            return self.projection_columns
        return columns_of(self.projection.to(device))

    @property
    def sketch_dim(self) -> int:
        return self.signs.shape[-1] * 8

    @property
    def outlier_sketch_dim(self) -> int:
        return 0 if self.outlier_signs is None else self.outlier_signs.shape[-1] * 8

    @property
    def num_outliers(self) -> int:
        return 0 if self.outlier_channels is None else self.outlier_channels.shape[-1]


def bf16_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``x`` as two bfloat16 tensors ``hi + lo`` (each rounded to nearest even, ``x - hi`` exact in float32): the
    kernels' ``tl.dot`` operands against exact ``+-1`` signs, ``hi . sign + lo . sign`` on tensor cores at about float32
    accuracy (:func:`~kvcomp.kernels.formats.sketch_triton.dot_scores`)."""
    hi = x.to(torch.bfloat16)
    return hi, (x - hi.float()).to(torch.bfloat16)


def columns_of(projection: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``S^T`` ``[D, m]`` of a projection ``S [m, D]``, contiguous, in float32 and as its two :func:`bf16_parts`:
    column ``c`` of ``S`` (what channel ``c`` adds to ``S q``) as one contiguous row for the kernels."""
    columns = projection.float().T.contiguous()
    return (columns, *bf16_parts(columns))


def reconstruct_keys(keys: SketchedKeys, head_dim: int) -> torch.Tensor:
    """``k_hat`` float32 ``[B, H, T, D]``, whose logits ``<q, k_hat>`` equal the estimator's: on each part,
    ``sqrt(pi/2)/m' ||k'|| S'^T sign(S' k')`` (outlier channels from the outlier sketch)."""
    projection = keys.projection.to(keys.signs.device)

    def reconstruct(signs, norm, rows):
        return estimator_scale(rows) * norm.float()[..., None] * (unpack_signs(signs, rows) @ projection[:rows])

    k_hat = reconstruct(keys.signs, keys.inlier_norm, keys.sketch_dim)
    if keys.num_outliers:
        mask = channel_mask(keys.outlier_channels, head_dim, keys.group_size)
        k_hat = torch.where(mask, reconstruct(keys.outlier_signs, keys.outlier_norm, keys.outlier_sketch_dim), k_hat)
    return k_hat


class Outliers(NamedTuple):
    """QJL's outlier channels: the projection ``S`` (whose columns build ``u_g`` on the register path) and its columns as
    rows (``S^T`` as two bfloat16 parts, :func:`columns_of`: the ``tl.dot`` path's), their sketch's signs and norms,
    their channel ids per group, and their estimator scale."""

    projection: torch.Tensor
    columns_hi: torch.Tensor
    columns_lo: torch.Tensor
    signs: Strided
    norm: Strided
    channels: Strided
    scale: float


class SketchArgs(NamedTuple):
    """Sign bits and norms per token, the step's projected queries ``y = S q`` ``[B, H, R, m]`` (float32, and its two
    bfloat16 parts, contiguous alike) and the estimator's scale ``sqrt(pi/2)/m`` (Eq. 4); ``outliers``:
    :class:`Outliers`, or ``()``."""

    signs: Strided
    norm: Strided
    y: Strided
    y_hi: torch.Tensor
    y_lo: torch.Tensor
    scale: float
    outliers: tuple


class SketchConstants(NamedTuple):
    M: int  # sketch rows
    M_OUT: int  # outlier sketch rows
    N_OUT: int  # outlier channels per group
    GROUP: int  # tokens per outlier group
    M_PAD: int  # M as a power of two
    ROWS: int  # query rows a program stacks (a power of two; sketch_triton.dot_scores)
    IN_PAD: int  # rows of the operand stacked against the inlier signs: y's two parts, then the outlier columns'
    OUT_PAD: int  # rows of the one against the outlier signs: the outlier columns' two parts

    @staticmethod
    def of(m: int, m_out: int, n_out: int, group: int, rows: int) -> SketchConstants:
        """The constants of a sketch of ``m`` + ``m_out`` rows and ``n_out`` outlier channels per ``group`` tokens,
        read by programs of ``rows`` query rows."""
        return SketchConstants(m, m_out, n_out, group, _power_of_two(m), 0, 0, _padded(2 * n_out)).stacking(rows)

    def stacking(self, rows: int) -> SketchConstants:
        """These constants for programs of ``rows`` query rows."""
        return self._replace(ROWS=_power_of_two(rows), IN_PAD=_padded(2 * _power_of_two(rows) + 2 * self.N_OUT))


def _power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _padded(n: int) -> int:
    """``n`` as a power of two of at least 16 (a ``tl.dot`` dimension)."""
    return max(16, _power_of_two(n))


def sketch_args(signs: torch.Tensor, norm: torch.Tensor, y: tuple, outliers=()) -> SketchArgs:
    """:class:`SketchArgs` of sign bits ``[B, H, T, m/8]``, norms ``[B, H, T]`` and projected queries ``y``: the
    contiguous float32 tensor and its two :func:`bf16_parts` (:func:`projected`)."""
    return SketchArgs(Strided.of(signs), Strided.of(norm), Strided.of(y[0]), *y[1:], estimator_scale(y[0].shape[-1]),
                      outliers)


def projected(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Projected queries ``y = S q`` as the kernels read them: contiguous float32 and its two :func:`bf16_parts`."""
    y = y.float().contiguous()
    return (y, *bf16_parts(y))


@dataclass
class SketchReader(PayloadReader):
    """QJL's sign-sketched keys (:class:`SketchedKeys`). The kernel scores them from their sign bits
    (:mod:`kvcomp.kernels.qjl_scores`: Eq. 4 plus the outlier term); the reference decodes ``k_hat``
    (:func:`reconstruct_keys`), whose logits are the same."""

    keys: SketchedKeys
    sign_scores = True

    def dequantize_unrotated(self) -> torch.Tensor:
        return reconstruct_keys(self.keys, self.head_dim)

    @property
    def kv_heads(self) -> int:
        return self.keys.signs.shape[1]

    def tile_limit(self, block_tokens: int, dot: bool) -> int:
        """Within one group of outlier channels."""
        return min(block_tokens, self.keys.group_size)

    def packed_scores(self, head_dim: int, dot: bool) -> bool:
        return True  # always scored from the bits

    def register_cap(self, narrow: bool, num_warps: int) -> int:
        """Four programs per multiprocessor in ``narrow`` tiles: the fused step with KIVI-2 values then spills 24-40
        bytes per thread under Triton 3.6 where the compiler takes 168 registers, and is predicted 8 % faster at 16 x
        32K (static model, as it predicted the codebook kernels' cap; not measured)."""
        return four_programs(num_warps) if narrow else 0


    def kernel_args(self, query: CallQuery) -> tuple[SketchArgs, SketchConstants]:
        """The sign bits and norms, the projected queries ``y = S q`` ``[B, H, R, m]`` (derived from the call's query
        once, for all its launches), the outliers' signs, norms and channels, and the sketch sizes."""
        keys = self.keys
        q = query.q
        columns = keys.columns(q.device)
        y = query.derived(("y = S q", id(self)), lambda q, s_t=columns[0]: projected(q.float() @ s_t))
        m, m_out, n_out = keys.sketch_dim, keys.outlier_sketch_dim, keys.num_outliers
        outliers = ()
        if n_out:
            outliers = Outliers(keys.projection.to(q.device, torch.float32).contiguous(), *columns[1:],
                                Strided.of(keys.outlier_signs), Strided.of(keys.outlier_norm),
                                Strided.of(keys.outlier_channels), estimator_scale(m_out))
        return (sketch_args(keys.signs, keys.inlier_norm, y, outliers),
                SketchConstants.of(m, m_out, n_out, keys.group_size, q.shape[2]))


@dataclass
class SignReader(PayloadReader):
    """Values ``x = norm * (+-1)`` from sign bits packed 8 per byte (``signs`` uint8 ``[B, H, T, D/8]``, bit ``c % 8`` of
    byte ``c // 8``) and one ``norm`` per token and head ``[B, H, T]``: TurboQuant-prod's residual sketch
    ``sign(S r)`` with ``||r||``, read in the sketch's basis (:class:`~kvcomp.kernels.formats.wrappers.ResidualSketchReader`).
    The kernel reads it as values, or as a key payload's residual; QJL's sketched keys are :class:`SketchReader`."""

    signs: torch.Tensor
    norm: torch.Tensor
    values_only = True

    @property
    def kv_heads(self) -> int:
        return self.signs.shape[1]


    def kernel_args(self, query: CallQuery) -> tuple[tuple[Strided, Strided], tuple]:
        """The bits and norms; no constants."""
        return (Strided.of(self.signs), Strided.of(self.norm)), ()

    def residual_args(self, query: CallQuery, rotation: torch.Tensor | None,
                      projection: torch.Tensor) -> tuple[SketchArgs, SketchConstants]:
        """The kernel's arguments for these bits as the residual sketch of keys, scored against ``y = S q`` ``[B, H, R,
        d]`` of the model's query ``q`` (``projection``: ``S``): those of a :class:`SketchReader` without outliers
        (its device functions: :func:`~kvcomp.kernels.formats.kernels_triton.residual_format`).
        ``y`` is derived from the call's query (the model's rotated by ``rotation^T`` where given: ``q = query
        rotation``) once per call, and remade from a CUDA graph's own query at every replay."""
        m = projection.shape[0]
        if m != self.head_dim or m % 8:
            raise ValueError(f"decode kernel: a residual sketch has one sign bit per channel, in whole bytes; got {m} "
                             f"rows for head_dim {self.head_dim}")
        y = query.derived(("residual y = S q", id(self)), lambda q: projected(unrotated(q, rotation) @ projection.float().T))
        return sketch_args(self.signs, self.norm, y), SketchConstants.of(m, 0, 0, 1, query.q.shape[2])

    def dequantize_unrotated(self) -> torch.Tensor:
        return unpack_signs(self.signs, self.head_dim) * self.norm.float()[..., None]
