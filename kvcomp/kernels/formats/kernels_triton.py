"""The split kernel's device functions of each payload format, by reader class: one line per format (its
``*_triton`` module imports its reader, never the other way round)."""

from kvcomp.kernels.formats.block_float import BlockFloatReader
from kvcomp.kernels.formats.block_float_triton import BLOCK_FLOAT
from kvcomp.kernels.formats.codebook import CodebookReader
from kvcomp.kernels.formats.codebook_triton import CODEBOOK
from kvcomp.kernels.formats.scaled import ScaledReader
from kvcomp.kernels.formats.scaled_triton import SCALED
from kvcomp.kernels.formats.sketch import SignReader, SketchReader
from kvcomp.kernels.formats.sketch_triton import SIGNS, SKETCH
from kvcomp.kernels.formats.uniform import UniformReader
from kvcomp.kernels.formats.uniform_triton import UNIFORM

KERNEL_FORMATS = {
    UniformReader: UNIFORM,
    BlockFloatReader: BLOCK_FLOAT,
    CodebookReader: CODEBOOK,
    SketchReader: SKETCH,
    SignReader: SIGNS,
    ScaledReader: SCALED,
}
# the device functions that score a key payload's residual, by the residual's reader class (its ``residual_args``)
RESIDUAL_FORMATS = {SignReader: SKETCH}  # scored as sketched keys without outliers


def kernel_format(reader):
    """The :class:`~kvcomp.kernels.formats.base.KernelFormat` of a reader."""
    found = KERNEL_FORMATS.get(type(reader))
    if found is None:
        raise NotImplementedError(f"the fused decode kernel cannot read a {type(reader).__name__} payload")
    return found


def residual_format(reader):
    """The :class:`~kvcomp.kernels.formats.base.KernelFormat` that scores a reader as a key payload's residual."""
    found = RESIDUAL_FORMATS.get(type(reader))
    if found is None:
        raise NotImplementedError(f"the fused decode kernel cannot score a {type(reader).__name__} as a key residual")
    return found
