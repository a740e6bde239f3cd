"""Payload formats, one module each: its reader (torch decoding and the split kernel's arguments) and, beside it in
``<format>_triton``, its Triton device functions (Triton is optional: only the launcher imports them).
:mod:`~kvcomp.kernels.formats.base` states the contract; a new format is its two modules plus a line in
:mod:`~kvcomp.kernels.formats.kernels_triton` (and its reader's export here).

The split kernel (:mod:`kvcomp.kernels.decode_attention_triton`) is compiled per (key format, value format): each
takes only its own arguments, and the kernel calls its device functions (:class:`~.base.KernelFormat`)."""

from kvcomp.kernels.formats.base import (CallQuery, KernelFormat, PayloadReader, RotaryPositions, Segment, in_place,
                                         segment_length)
from kvcomp.kernels.formats.block_float import BlockFloatReader
from kvcomp.kernels.formats.codebook import CodebookReader, fused_encode_supported
from kvcomp.kernels.formats.scaled import ScaledReader
from kvcomp.kernels.formats.sketch import SignReader, SketchedKeys, SketchReader, reconstruct_keys
from kvcomp.kernels.formats.uniform import UniformReader
from kvcomp.kernels.formats.wrappers import OffsetReader, ResidualSketchReader, RotatedReader

__all__ = [
    "BlockFloatReader", "CallQuery", "CodebookReader", "KernelFormat", "OffsetReader", "PayloadReader",
    "ResidualSketchReader", "RotaryPositions", "RotatedReader", "ScaledReader", "Segment", "SignReader", "SketchReader",
    "SketchedKeys", "UniformReader", "fused_encode_supported", "in_place", "reconstruct_keys", "segment_length",
]
