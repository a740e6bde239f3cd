"""Codebook encoding of a normalised block: the torch reference
(:meth:`kvcomp.stages.codebook.CodebookQuantizer.encode`) or the fused nearest-centroid + packing kernel
of :mod:`kvcomp.kernels.codebook_encode_triton` (imported only when used: triton is optional)."""

from __future__ import annotations

import torch

from kvcomp.kernels.formats import fused_encode_supported
from kvcomp.stages.codebook import CodebookQuantizer


def encode_codebook(quantizer: CodebookQuantizer, z: torch.Tensor, codebooks: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """``z [B, H, T, D]`` (normalised) -> packed uint8 codes ``[B, H, T/tl, bytes]``: ``quantizer.encode``
    (``backend="torch"``) or, with ``backend="triton"`` where every codebook group fills whole bytes, the
    fused kernel (the same codes except at exact distance ties)."""
    if backend == "triton" and fused_encode_supported(quantizer.layout, quantizer.code_bits):
        from kvcomp.kernels.codebook_encode_triton import encode_codebook_triton

        return encode_codebook_triton(z, codebooks, quantizer.layout, quantizer.code_bits)
    return quantizer.encode(z, codebooks)
