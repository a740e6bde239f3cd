"""Rotary position embedding helpers for pre-RoPE codecs.

Transformers applies RoPE as ``k_rot = k * cos + rotate_half(k) * sin`` (a rotation of each channel
pair by the token's angle). Its inverse is the rotation by the opposite angle:
``k = k_rot * cos - rotate_half(k_rot) * sin``. The cache un-rotates keys before a pre-RoPE codec
encodes them and re-rotates decoded keys with the same ``cos``/``sin``; calibration records keys
un-rotated, and the decode-attention reference rotates decoded keys (a stage: every layer above uses it).
"""

import torch

from kvcomp.stages.ranges import saturated


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, T, D]`` by positions whose ``cos``/``sin`` are ``[B, T, D]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return saturated(x.float() * cos + rotate_half(x.float()) * sin, x.dtype)


def undo_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`apply_rope`."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return saturated(x.float() * cos - rotate_half(x.float()) * sin, x.dtype)
