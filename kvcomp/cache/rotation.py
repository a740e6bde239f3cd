"""How a stream's tokens depend on their positions before they are encoded and after they are decoded."""

from __future__ import annotations

import torch

from kvcomp.codecs.base import Codec
from kvcomp.stages.ranges import saturated
from kvcomp.stages.rope import apply_rope, undo_rope


class KeyRotation:
    """A stream's rotation by position. ``rope(first, count)`` returns the layer's cos/sin of cached tokens
    ``first .. first + count - 1``. Pre-RoPE keys (``pre_rope``) are un-rotated before encoding and re-rotated when
    decoded, with the positions' own angles; a post-RoPE codec's key ``offset`` ``c``
    (:meth:`~kvcomp.codecs.base.Codec.rotated_key_offset`) is rotated to each token's position, ``R_p c``, subtracted
    before encoding and added back after decoding. Values, and other keys, are encoded as they come."""

    def __init__(self, codec: Codec, kind: str, layer_idx: int, rope):
        self.rope = rope
        self.pre_rope = codec.pre_rope and kind == "key"
        self.offset = codec.rotated_key_offset(layer_idx) if kind == "key" and not self.pre_rope else None

    @property
    def rotates(self) -> bool:
        """Whether the stream needs its tokens' RoPE angles (``rope``)."""
        return self.pre_rope or self.offset is not None

    def _rotated_offset(self, first: int, count: int, like: torch.Tensor) -> torch.Tensor:
        """``R_p c`` of cached tokens ``first .. first + count - 1``, float32 ``[B, H, count, D]``."""
        if self.offset.device != like.device:
            self.offset = self.offset.to(like.device)
        c = self.offset.float()[None, :, None, :].expand(like.shape[0], -1, count, -1)
        return apply_rope(c, *self.rope(first, count))

    def to_encode(self, x: torch.Tensor, first: int) -> torch.Tensor:
        """Tokens ``x`` from cache index ``first`` as the codec encodes them."""
        if self.pre_rope:
            return undo_rope(x, *self.rope(first, x.shape[2]))
        if self.offset is not None:
            return saturated(x.float() - self._rotated_offset(first, x.shape[2], x), x.dtype)
        return x

    def from_decoded(self, x: torch.Tensor, first: int) -> torch.Tensor:
        """Decoded tokens ``x`` from cache index ``first`` as attention reads them."""
        if self.pre_rope:
            return apply_rope(x, *self.rope(first, x.shape[2]))
        if self.offset is not None:
            return saturated(x.float() + self._rotated_offset(first, x.shape[2], x), x.dtype)
        return x
