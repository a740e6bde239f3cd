"""Rotary position embedding helpers for pre-RoPE codecs.

Transformers applies RoPE as ``k_rot = k * cos + rotate_half(k) * sin`` (a rotation of each channel
pair by the token's angle, times the RoPE's attention scaling where it has one). Its inverse is the rotation by the
opposite angle, ``k = k_rot * cos - rotate_half(k_rot) * sin``, divided by that scaling squared. The cache un-rotates keys before a pre-RoPE codec
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
    """Inverse of :func:`apply_rope`, also where the model's cos/sin carry its RoPE's attention scaling ``s`` (YaRN,
    LongRoPE: ``cos = s cos(theta)``, so that rotating costs a factor ``s``): the rotation by the opposite angle, divided
    by ``cos^2 + sin^2 = s^2``. Where that is 1 up to the rounding of cos/sin (``|s^2 - 1| < 0.01``: bf16 cos/sin
    miss it by up to 0.006; YaRN's smallest scaling, factor 1.1, gives 1.019) it divides by exactly 1: every RoPE
    without attention scaling is undone by the plain opposite rotation, bit for bit as without the division."""
    cos, sin = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    norm = cos * cos + sin * sin
    norm = torch.where((norm - 1).abs() < 0.01, torch.ones_like(norm), norm)
    return saturated((x.float() * cos - rotate_half(x.float()) * sin) / norm, x.dtype)


def rope_transpose(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The transpose of :func:`apply_rope`'s map (the rotation by the opposite angle, times ``s``): what carries a
    gradient with respect to rotated keys back to the keys before RoPE (``dL/dk = s R^T dL/dk_rot``)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return saturated(x.float() * cos - rotate_half(x.float()) * sin, x.dtype)
