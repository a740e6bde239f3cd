"""kvtc's transform coding of token feature rows (kvtc spec §3.3-3.6, K7): PCA across every layer and head,
coefficients coded with a :class:`~kvcomp.stages.bit_allocation.Plan`, packed into one byte stream, DEFLATE.

Features: per token, the keys (or values) of every layer and KV head concatenated in (layer, head, dim)
order, ``p = layers x heads x head_dim`` columns (:func:`feature_rows`); columns ``l*H*d .. (l+1)*H*d`` are
layer ``l`` (per-layer decompression reads that slice of the basis).

Byte stream of ``N`` rows (K7): for every kept group in plan order, its ``N x s`` codes (row-major: all
tokens of group g, then group g+1), int2 four and int4 two per byte (LSB first), fp8 one byte, fp16 two;
then every kept group's fp16 shift and scale arrays, group-major (none for fp16 groups). ``zlib`` (DEFLATE, level 6) compresses the stream:
as a whole zlib stream (:func:`deflate` without ``history``), or as the next segment of one raw DEFLATE stream
that runs over a sequence's blocks (with ``history``, the last :data:`WINDOW` bytes before it).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

from kvcomp.errors import DamagedPayloadError, NonFiniteKVError
from kvcomp.stages.bit_allocation import TYPE_BITS, Plan, group_codes, group_values
from kvcomp.stages.packing import pack_bits, packed_length, unpack_bits

FLOAT_TYPES = {"fp8": torch.float8_e4m3fn, "fp16": torch.float16}  # stored as their bytes


def feature_rows(layers: list[torch.Tensor]) -> torch.Tensor:
    """``[B, H, T, d]`` per layer -> rows ``[B * T, L * H * d]`` in (layer, head, dim) column order."""
    x = torch.stack(layers, dim=1)  # [B, L, H, T, d]
    b, num_layers, h, t, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b * t, num_layers * h * d)


@dataclass
class PCABasis:
    """``mean [p]`` and orthonormal ``basis [p, r]`` (stored in fp16, as the paper does; applied in float32)."""

    mean: torch.Tensor
    basis: torch.Tensor

    def project(self, rows: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """Coefficients of ``rows`` on the leading ``width`` components (all by default)."""
        return (rows.float() - self.mean.float()) @ self.basis[:, :width].float()

    def reconstruct(self, coefficients: torch.Tensor, columns: slice = slice(None)) -> torch.Tensor:
        """Rows from the leading ``coefficients.shape[1]`` coefficients; ``columns``: only these feature
        columns (e.g. one layer's)."""
        basis = self.basis[columns, : coefficients.shape[1]]
        return coefficients.float() @ basis.float().T + self.mean[columns].float()


def fit_pca(rows: torch.Tensor, rank: int, niter: int = 8, seed: int = 0, dtype=torch.float16) -> PCABasis:
    """PCA of ``rows [N, p]``, rank capped at ``q = min(rank, N, p)``: randomized SVD (``torch.svd_lowrank``
    with the mean passed in, not subtracted, spec §3.4); when the cap keeps every component (``q = min(N,
    p)``), the exact SVD of the centred rows instead (the same decomposition, without the random sketch)."""
    rows = rows.float()
    mean = rows.mean(0)
    q = min(rank, *rows.shape)
    if q == min(rows.shape):
        v = torch.linalg.svd(rows - mean, full_matrices=False).Vh[:q].T
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            _, _, v = torch.svd_lowrank(rows, q=q, niter=niter, M=mean[None])
    return PCABasis(mean.to(dtype), v.to(dtype))


def encode_rows(coefficients: torch.Tensor, plan: Plan) -> torch.Tensor:
    """The byte stream (uint8, not yet deflated) of ``coefficients [N, r]`` under ``plan``. Coefficients beyond
    float16's range (shifts, scales and fp16 codes would be Inf) are refused (:class:`NonFiniteKVError`)."""
    codes, params, halves = [], [], []
    for start, end, kind in plan.groups:
        if kind == "none":
            continue
        c, shift, scale = group_codes(coefficients[:, start:end], kind)
        flat = c.reshape(-1)
        codes.append(flat.view(torch.uint8) if kind in FLOAT_TYPES else pack_bits(flat, TYPE_BITS[kind]))
        params += [shift.reshape(-1).view(torch.uint8), scale.reshape(-1).view(torch.uint8)]
        halves += [len(codes) - 1] if kind == "fp16" else []
    parts = [t.cpu() for t in codes + params]  # the stream is deflated on the host: checked there, without a sync
    stored = [parts[i] for i in halves] + parts[len(codes):]
    if not all(np.isfinite(t.view(torch.float16).numpy()).all() for t in stored):
        raise NonFiniteKVError(f"PCA coefficients beyond the float16 range (max {torch.finfo(torch.float16).max:.0f}) "
                               "in which kvtc stores coefficients, shifts and scales: inputs this large cannot be coded")
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def decode_rows(stream: torch.Tensor, plan: Plan, num_rows: int) -> torch.Tensor:
    """Inverse of :func:`encode_rows`: float32 ``[num_rows, r]`` (dropped groups are zero)."""
    kept = [(start, end, kind) for start, end, kind in plan.groups if kind != "none"]
    offset, codes = 0, []
    for start, end, kind in kept:
        count = num_rows * (end - start)
        size = count * TYPE_BITS[kind] // 8 if kind in FLOAT_TYPES else packed_length(count, TYPE_BITS[kind])
        chunk = stream[offset:offset + size]
        codes.append(chunk.view(FLOAT_TYPES[kind]) if kind in FLOAT_TYPES else unpack_bits(chunk, TYPE_BITS[kind], count))
        offset += size
    out = torch.zeros(num_rows, plan.groups[-1][1] if plan.groups else 0)
    for (start, end, kind), c in zip(kept, codes):
        if kind == "fp16":
            out[:, start:end] = c.view(num_rows, end - start).float()
            continue
        shift = stream[offset:offset + 2 * num_rows].view(torch.float16)[:, None]
        scale = stream[offset + 2 * num_rows:offset + 4 * num_rows].view(torch.float16)[:, None]
        offset += 4 * num_rows
        out[:, start:end] = group_values(c.view(num_rows, end - start), shift, scale)
    return out


WINDOW = 32768  # DEFLATE's largest window: how far back a segment of a sequence's stream may refer


def deflate(stream: torch.Tensor, level: int = 6, history: bytes | None = None) -> bytes:
    """``stream`` DEFLATEd: a whole zlib stream (``history`` None), or the next segment of a raw DEFLATE stream
    whose bytes so far end with ``history`` (its last :data:`WINDOW` or fewer), flushed with ``Z_SYNC_FLUSH``: the
    segment ends on a byte boundary and :func:`inflate` decodes it from ``history`` alone (the segments, in order,
    are one DEFLATE stream)."""
    if history is None:
        return zlib.compress(stream.numpy().tobytes(), level)
    compressor = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS, zdict=history)
    return compressor.compress(stream.numpy().tobytes()) + compressor.flush(zlib.Z_SYNC_FLUSH)


def inflate(data: bytes, size: int, history: bytes | None = None) -> torch.Tensor:
    """The ``size`` bytes a DEFLATE stream holds (``history`` None), or a segment of one (``history``: the
    stream's last :data:`WINDOW` or fewer bytes before it, as :func:`deflate` took them); never inflates more than
    ``size + 1`` bytes, so a stream that holds more (a decompression bomb) or less, or a segment with bytes left
    over, is refused (:class:`DamagedPayloadError`) at that cost."""
    inflater = zlib.decompressobj() if history is None else zlib.decompressobj(-zlib.MAX_WBITS, zdict=history)
    try:
        raw = inflater.decompress(data, size + 1)
    except zlib.error as exc:
        raise DamagedPayloadError(f"a DEFLATE stream is corrupt ({exc}): the stored payload is damaged") from exc
    ended = inflater.eof if history is None else not inflater.unused_data
    _check_held(len(raw) + (1 if inflater.unconsumed_tail else 0), size, ended)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)


def _check_held(held: int, size: int, ended: bool) -> None:
    if held != size or not ended:
        said = f"more than {size}" if held > size else str(held)
        raise DamagedPayloadError(f"a DEFLATE stream holds {said} bytes where its plan implies {size}: the stored "
                                  "payload is damaged or crafted")


def check_inflates_to(data: bytes, size: int, chunk: int = 1 << 16) -> None:
    """Refuse (:class:`DamagedPayloadError`, as :func:`inflate` does) a whole zlib stream that does not hold exactly
    ``size`` bytes, inflating it ``chunk`` bytes at a time and keeping none: memory stays one chunk, whatever
    ``size`` claims and whatever the stream holds."""
    inflater, held, rest = zlib.decompressobj(), 0, data
    try:
        while held <= size and not inflater.eof:
            out = len(inflater.decompress(rest, chunk))
            held, rest = held + out, inflater.unconsumed_tail
            if not rest and out < chunk:  # all the input is read and inflated
                break
    except zlib.error as exc:
        raise DamagedPayloadError(f"a DEFLATE stream is corrupt ({exc}): the stored payload is damaged") from exc
    _check_held(held, size, inflater.eof)
