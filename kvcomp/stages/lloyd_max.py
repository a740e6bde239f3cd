"""Lloyd-Max scalar codebooks for the coordinates of a randomly rotated unit vector, and the rotated scalar
quantizer that TurboQuant (Zandieh et al., ICLR 2026, arXiv 2504.19874) and EDEN (Vargaftik et al., ICML 2022;
arXiv 2604.18555 compares the two) are built from.

**The density.** A coordinate ``X`` of a uniformly random unit vector in ``R^d`` (what any fixed unit vector
becomes after a Haar-random rotation) has the density of TurboQuant's Lemma 1,

    f(x) = Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2)) (1 - x^2)^((d-3)/2),   -1 <= x <= 1     (``density="beta"``),

a scaled Beta((d-1)/2, (d-1)/2), with variance ``1/d``; for large ``d`` it tends to ``N(0, 1/d)``
(``density="gaussian"``, what vLLM's ``centroids.py`` and EDEN's reference tables use).

**The codebook** (:func:`lloyd_max`): the ``2^b`` centroids minimising ``E (X - Q(X))^2`` (TurboQuant's Eq. 4, a
continuous 1-D k-means), found by Lloyd-Max iterations (boundaries at midpoints, centroids at the conditional
means) on a fine float64 grid of ``f`` (cumulative trapezoid tables of ``f`` and ``x f``, interpolated at the
boundaries), from a quantile start until no centroid moves by more than ``1e-10 / sqrt(d)``. Deterministic, a
fraction of a second, kept in memory per ``(bits, d, density)``. ``ScalarCodebook.distortion`` is
``d E (X - Q(X))^2``: the expected squared error of a unit vector, TurboQuant's ``D_mse`` (Theorem 1 quotes
0.36, 0.117, 0.03, 0.009 for b = 1..4).

**Rotations** (:class:`Rotation`, one per codec, shared by every layer and head): ``random``, a Haar orthogonal
matrix (QR of a seeded Gaussian, signs fixed by ``diag(R)``: TurboQuant's Algorithm 1); ``hadamard``, the
randomized Hadamard transform ``H D / sqrt(d)`` with seeded random signs ``D`` (EDEN's reference code;
``d`` a power of two); ``plain_hadamard``, ``H / sqrt(d)`` without signs (vLLM's TurboQuant backend).

**The quantizer** (:class:`RotatedScalarQuantizer`): ``u = Pi x / ||x||``, ``c = Q(u)`` coordinate-wise (codes
packed at ``b`` bits), one stored float ``s`` per vector, ``x_hat = s Pi^T c`` with ``s = ||x|| S`` and

- ``scale="one"``: ``S = 1`` (TurboQuant-mse, Algorithm 1 with the norm stored);
- ``scale="unit"``: ``S = 1 / ||c||``, applied at decode from the codes (vLLM's ``norm_correction``, the "nc"
  presets: the reconstruction keeps the input's norm);
- ``scale="biased"``: ``S = <u, c> / ||c||^2``, the MSE-optimal scale (the projection of ``u`` on ``c``; EDEN's
  biased variant);
- ``scale="unbiased"``: ``S = 1 / <u, c> = ||u||^2 / <u, c>`` (EDEN's reference code, ``scale = ||x||^2 / <c, x>``):
  ``E[x_hat] = x`` over the random rotation (EDEN's unbiasedness theorem).

**TurboQuant-prod** (:class:`ProdQuantizer`, Algorithm 2): TurboQuant-mse at ``b - 1`` bits, then a QJL sketch
of the residual ``r = x - x_mse``: ``sign(S r)`` (``d`` bits, ``S`` a ``d x d`` i.i.d. N(0, 1) matrix,
:mod:`kvcomp.stages.jl_sketch`) and ``gamma = ||r||``; ``x_hat = x_mse + sqrt(pi/2) / d gamma S^T sign(S r)``,
whose inner products are unbiased over ``S``.

Stored floats (the norm / ``s``, ``gamma``) are kept in a 16-bit dtype (float16, as vLLM) or, for a block whose
values it cannot hold, in float32 (:func:`~kvcomp.stages.ranges.stored_in`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from kvcomp.stages.hadamard import fwht, is_power_of_two
from kvcomp.stages.jl_sketch import estimator_scale, jl_projection, sign_sketch, unpack_signs
from kvcomp.stages.packing import pack_bits, packed_length, unpack_bits
from kvcomp.stages.ranges import stable_norm, stored_in

DENSITIES = ("beta", "gaussian")
ROTATIONS = ("random", "hadamard", "plain_hadamard")
SCALES = ("one", "unit", "biased", "unbiased")
GRID_POINTS = 1 << 16  # of the density's grid (about 2700 per standard deviation)
SPAN = 12.0  # the grid covers +-SPAN standard deviations (cut at +-1 for the beta density)
MAX_ITERATIONS = 20_000
TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True, eq=False)
class ScalarCodebook:
    """Sorted ``centroids [2^b]`` and the ``boundaries [2^b - 1]`` between them (float32, in units of a unit
    vector's coordinate), and ``distortion = d E (X - Q(X))^2``."""

    centroids: torch.Tensor
    boundaries: torch.Tensor
    distortion: float


def coordinate_density(x: torch.Tensor, dim: int, density: str) -> torch.Tensor:
    """The density of one coordinate of a uniformly random unit vector in ``R^dim`` (``beta``, exact) or its
    Gaussian limit ``N(0, 1/dim)`` (``gaussian``), at ``x`` (float64)."""
    if density == "gaussian":
        return torch.exp(-0.5 * dim * x.square()) * math.sqrt(dim / (2 * math.pi))
    if density != "beta" or dim < 3:
        raise ValueError(f"density {density!r} for d={dim}: valid are {DENSITIES} (beta needs d >= 3)")
    log_constant = math.lgamma(dim / 2) - math.lgamma((dim - 1) / 2) - 0.5 * math.log(math.pi)
    inside = (1 - x.square()).clamp_min(0)
    return torch.exp(log_constant + (dim - 3) / 2 * torch.log(inside))


def _cumulative(values: torch.Tensor, step: float) -> torch.Tensor:
    """Cumulative trapezoid integral of ``values`` on a uniform grid, starting at 0."""
    return torch.cat([values.new_zeros(1), torch.cumsum((values[1:] + values[:-1]) * (step / 2), 0)])


@lru_cache(maxsize=None)
def lloyd_max(bits: int, dim: int, density: str = "beta") -> ScalarCodebook:
    """The ``bits``-bit Lloyd-Max codebook of a unit vector's coordinate in ``R^dim`` (module docstring)."""
    if not 1 <= bits <= 8:
        raise ValueError(f"Lloyd-Max codebooks of 1..8 bits, got {bits}")
    sigma = 1 / math.sqrt(dim)
    span = SPAN * sigma if density == "gaussian" else min(1.0, SPAN * sigma)
    x = torch.linspace(-span, span, GRID_POINTS, dtype=torch.float64)
    step = 2 * span / (GRID_POINTS - 1)
    pdf = coordinate_density(x, dim, density)
    mass, first = _cumulative(pdf, step), _cumulative(x * pdf, step)
    total = mass[-1].item()
    second = _cumulative(x.square() * pdf, step)[-1].item() / total
    mass, first = mass / total, first / total

    def at(table: torch.Tensor, points: torch.Tensor) -> torch.Tensor:  # linear interpolation of a table
        upper = torch.searchsorted(x, points).clamp(1, GRID_POINTS - 1)
        weight = (points - x[upper - 1]) / step
        return table[upper - 1] + weight * (table[upper] - table[upper - 1])

    levels = 1 << bits
    quantiles = (torch.arange(levels, dtype=torch.float64) + 0.5) / levels
    centroids = x[torch.searchsorted(mass, quantiles).clamp(max=GRID_POINTS - 1)]
    for _ in range(MAX_ITERATIONS):
        edges = torch.cat([x[:1], (centroids[1:] + centroids[:-1]) / 2, x[-1:]])
        cell_mass, cell_first = at(mass, edges).diff(), at(first, edges).diff()
        updated = cell_first / cell_mass.clamp_min(1e-300)
        moved = (updated - centroids).abs().max().item()
        centroids = updated
        if moved < 1e-10 * sigma:
            break
    cell_mass = at(mass, torch.cat([x[:1], (centroids[1:] + centroids[:-1]) / 2, x[-1:]])).diff()
    distortion = dim * (second - (centroids.square() * cell_mass).sum().item())
    return ScalarCodebook(centroids.float(), ((centroids[1:] + centroids[:-1]) / 2).float(), distortion)


@dataclass(eq=False)
class Rotation:
    """An orthogonal map of ``dim``-vectors (module docstring), drawn on the CPU from ``seed``."""

    kind: str
    dim: int
    seed: int = 0
    on_device: dict = field(default_factory=dict, repr=False)  # the held tensor per device

    def __post_init__(self):
        if self.kind not in ROTATIONS:
            raise ValueError(f"rotation {self.kind!r}: valid are {ROTATIONS}")
        if self.kind != "random" and not is_power_of_two(self.dim):
            raise ValueError(f"a {self.kind} rotation needs a power-of-two dimension, got {self.dim}")
        generator = torch.Generator().manual_seed(self.seed)
        if self.kind == "random":
            q, r = torch.linalg.qr(torch.randn(self.dim, self.dim, generator=generator, dtype=torch.float64))
            self.held = (q * torch.where(r.diagonal() < 0, -1.0, 1.0)).float()  # Haar: signs fixed by diag(R)
        elif self.kind == "hadamard":
            self.held = torch.randint(0, 2, (self.dim,), generator=generator).float() * 2 - 1
        else:
            self.held = torch.ones(self.dim)

    def _on(self, device: torch.device) -> torch.Tensor:
        if device not in self.on_device:
            self.on_device[device] = self.held.to(device)
        return self.on_device[device]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``Pi x`` over the last dimension (float32)."""
        held = self._on(x.device)
        if self.kind == "random":
            return x.float() @ held.T
        return fwht(x.float() * held) / math.sqrt(self.dim)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """``Pi^T y`` over the last dimension (float32)."""
        held = self._on(y.device)
        if self.kind == "random":
            return y.float() @ held
        return fwht(y.float()) / math.sqrt(self.dim) * held

    @property
    def bits(self) -> int:
        """What it holds in memory (float32; regenerable from the seed)."""
        return 32 * self.held.numel()


@dataclass(eq=False)
class RotatedScalarQuantizer:
    """Rotated Lloyd-Max quantization of ``[..., dim]`` vectors with a per-vector scale (module docstring):
    payload ``{"codes": uint8 [..., bytes], "scale": [...]}``."""

    rotation: Rotation
    bits: int
    density: str = "beta"
    scale: str = "one"
    scale_dtype: torch.dtype = torch.float16
    on_device: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.scale not in SCALES:
            raise ValueError(f"scale {self.scale!r}: valid are {SCALES}")
        self.codebook = lloyd_max(self.bits, self.rotation.dim, self.density)

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self.on_device:
            self.on_device[device] = (self.codebook.centroids.to(device), self.codebook.boundaries.to(device))
        return self.on_device[device]

    def encode(self, x: torch.Tensor, range_checks: list | None = None) -> dict[str, torch.Tensor]:
        centroids, boundaries = self._tables(x.device)
        norm = stable_norm(x)
        u = self.rotation.forward(x.float() / norm.clamp_min(TINY)[..., None])
        index = torch.bucketize(u, boundaries)
        c = centroids[index]
        if self.scale == "biased":
            norm = norm * (u * c).sum(-1) / c.square().sum(-1).clamp_min(TINY)
        elif self.scale == "unbiased":
            norm = norm / (u * c).sum(-1).clamp_min(TINY)  # u_j c_j >= 0: Q keeps each coordinate's sign
        return {"codes": pack_bits(index.to(torch.uint8), self.bits), "scale": stored_in(norm, self.scale_dtype, range_checks)}

    def decode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The float32 ``[..., dim]`` reconstruction."""
        scale = tensors["scale"].float()
        centroids, _ = self._tables(scale.device)
        c = centroids[unpack_bits(tensors["codes"], self.bits, self.rotation.dim).long()]
        if self.scale == "unit":
            c = c / c.norm(dim=-1, keepdim=True).clamp_min(TINY)
        return self.rotation.inverse(c) * scale[..., None]

    def bits_per_vector(self) -> int:
        """Packed codes and the stored scale."""
        return 8 * packed_length(self.rotation.dim, self.bits) + torch.finfo(self.scale_dtype).bits

    @property
    def held_bits(self) -> int:
        """The codebook (float32; the rotation, which quantizers may share, is not counted)."""
        return 32 * self.codebook.centroids.numel()


@dataclass(eq=False)
class ProdQuantizer:
    """TurboQuant-prod at ``bits`` per coordinate: ``mse`` (a :class:`RotatedScalarQuantizer` of ``bits - 1``
    bits) and a 1-bit QJL sketch of its residual with the residual's norm (module docstring)."""

    mse: RotatedScalarQuantizer
    seed: int = 1  # of the Gaussian sketch matrix S (independent of the rotation's)
    on_device: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.projection = jl_projection(self.dim, self.dim, "gaussian", seed=self.seed)

    @property
    def dim(self) -> int:
        return self.mse.rotation.dim

    def _projection(self, device: torch.device) -> torch.Tensor:
        if device not in self.on_device:
            self.on_device[device] = self.projection.to(device)
        return self.on_device[device]

    def encode(self, x: torch.Tensor, range_checks: list | None = None) -> dict[str, torch.Tensor]:
        tensors = self.mse.encode(x, range_checks)
        residual = x.float() - self.mse.decode(tensors)
        tensors["signs"] = sign_sketch(residual, self._projection(x.device))
        tensors["residual_norm"] = stored_in(stable_norm(residual), self.mse.scale_dtype, range_checks)
        return tensors

    def decode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        signs = unpack_signs(tensors["signs"], self.dim)
        gamma = tensors["residual_norm"].float()[..., None] * estimator_scale(self.dim)
        return self.mse.decode(tensors) + gamma * (signs @ self._projection(signs.device))

    def bits_per_vector(self) -> int:
        return self.mse.bits_per_vector() + 8 * packed_length(self.dim, 1) + torch.finfo(self.mse.scale_dtype).bits

    @property
    def held_bits(self) -> int:
        return self.mse.held_bits + 32 * self.projection.numel()
