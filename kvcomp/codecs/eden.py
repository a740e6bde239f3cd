"""EDEN (Vargaftik, Ben-Basat, Portnoy, Mendelson, Ben-Itzhak, Mitzenmacher, ICML 2022) as a KV codec: TurboQuant-mse
with the reconstruction scale ``S`` chosen per vector (Ben-Basat et al., "A Note on TurboQuant and the Earlier
DRIVE/EDEN Line of Work", arXiv 2604.18555: TurboQuant-mse is EDEN with ``S = 1``).

Each key and value vector of one head and token (keys after RoPE) is rotated, ``u = Pi x / ||x||``, coded
coordinate-wise by the ``b``-bit Lloyd-Max codebook ``c = Q(u)`` and reconstructed as ``x_hat = s Pi^T c``, with one
stored float per vector, ``s = ||x|| S`` (:class:`~kvcomp.stages.lloyd_max.RotatedScalarQuantizer`):

- ``scale: biased``: ``S = <u, c> / ||c||^2``, the scale minimising ``||x - x_hat||`` (the least-squares
  projection of ``u`` on ``c``);
- ``scale: unbiased``: ``S = ||u||^2 / <u, c>``, which makes ``E[x_hat] = x`` over the random rotation (the
  scale of EDEN's reference code, ``scale = ||x||^2 / <c, x>``).

``s`` replaces TurboQuant's norm, so EDEN costs what TurboQuant-mse costs: ``d b + 16`` bits per vector
(float16 ``s``). Defaults as the authors' reference code (github.com/amitport/EDEN-Distributed-Mean-Estimation,
``torch/eden.py``): the randomized Hadamard rotation (``rotation: hadamard``) and the Lloyd-Max codebook of the
standard normal scaled to ``N(0, 1/d)`` (``density: gaussian``). ``center`` as :mod:`kvcomp.codecs.turboquant`
(not the paper's).

Differences from the reference code: the rotation's signs are drawn once from ``seed`` and shared by every
vector (the reference draws fresh signs per encode; its unbiasedness is over that draw), and ``s`` is stored in
float16 (the reference keeps a float32 scalar), which vLLM's and TurboQuant's norms use too; the reference pads
the vector to a power of two, here ``head_dim`` must be one for the Hadamard rotations (or ``rotation: random``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcomp.codecs.base import CodecConfig
from kvcomp.codecs.registry import register
from kvcomp.codecs.turboquant import LLOYD_MAX_BITS, RotatedCodec, fitted_fields
from kvcomp.codecs.uniform import PARAM_DTYPES
from kvcomp.errors import ConfigError, unknown_choice

EDEN_SCALES = ("biased", "unbiased")


@dataclass
class EdenConfig(CodecConfig):
    name: str = "eden"
    key_bits: int = 3  # 1..4 Lloyd-Max bits per coordinate
    value_bits: int = 3
    scale: str = "biased"  # biased (MSE-optimal S) | unbiased (E[x_hat] = x)
    rotation: str = "hadamard"  # hadamard (random signs, the reference) | random (Haar) | plain_hadamard
    density: str = "gaussian"  # gaussian (N(0, 1/d), the reference's tables) | beta (exact)
    scale_dtype: str = "float16"  # the stored s = ||x|| S
    seed: int = 0  # of the rotation
    skip_layers: list[int] = field(default_factory=list)  # layers kept in the model dtype (negative: from the end)
    boundary_layers: int = 0  # the first and last n layers kept in the model dtype
    center: str = "none"  # none (paper) | calibration | bias: take a per-layer offset out first (not the paper's)


@register
class EdenCodec(RotatedCodec):
    """EDEN keys and values with the biased (MSE-optimal) or unbiased scale (module docstring)."""

    config_class = EdenConfig
    inference_only_fields = fitted_fields(EdenConfig)

    @property
    def stored_dtype(self) -> torch.dtype:
        return PARAM_DTYPES[self.config.scale_dtype]

    def check_bits(self) -> None:
        cfg = self.config
        if cfg.scale not in EDEN_SCALES:
            raise unknown_choice("eden scale", cfg.scale, EDEN_SCALES)
        if cfg.scale_dtype not in PARAM_DTYPES:
            raise unknown_choice("eden scale_dtype", cfg.scale_dtype, PARAM_DTYPES)
        for kind in ("key_bits", "value_bits"):
            if getattr(cfg, kind) not in LLOYD_MAX_BITS:
                raise ConfigError(f"eden: {kind}={getattr(cfg, kind)} is not supported; valid: "
                                  f"{LLOYD_MAX_BITS[0]}..{LLOYD_MAX_BITS[-1]}")

    def coder(self, kind: str):
        return self.rotated(self.config.key_bits if kind == "key" else self.config.value_bits, self.config.scale)
