"""MSE-optimal grids for the standard Gaussian and nearest-point search (HIGGS, AQUA-KV spec §3.4).

A grid ``C`` of ``n`` points in ``R^d`` quantizes ``u ~ N(0, I_d)`` to its nearest point
``argmax_c (2 u.c - |c|^2)``. :func:`lloyd_grid` finds a locally MSE-optimal ``C`` by stochastic Lloyd
iterations: at step ``t`` a fresh batch of Gaussian samples is assigned to the Voronoi cells of ``C``
and every point moves toward its cell's centroid by ``gamma_t = gamma_0 A / (A + gamma_0 B t)``, with
``A = 4 n^(1/d)``, ``B = pi^2 n^(-2/d)`` and ``gamma_0 = 2``; steps are capped at 1 (a full Lloyd step:
a step past the centroid only overshoots). The reference used 10 M samples x 600 steps; the defaults
here (:data:`GRID_SAMPLES` x :data:`GRID_STEPS`) reach the same MSE to 3 digits on this machine's CPU in
well under a minute. The grids HIGGS uses by default (2-D, 16 / 64 / 256 points, seed 0) ship with the
package (``grid_data/``, 4 KB in all, made by ``scripts/make_grids.py``), so every machine uses the same
ones and none computes them; :func:`gaussian_grid` computes any other grid once (seeded) and caches it as a
small safetensors file under ``cache_dir()/grids``. Every file carries its sha256 and per-coordinate MSE
in its header and is checked when read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvcomp.artifacts import atomic_path, tensors_nbytes
from kvcomp.paths import cache_dir
from kvcomp.progress import progress

log = logging.getLogger(__name__)

GRID_SAMPLES = 100_000
GRID_STEPS = 300
CHUNK = 1 << 16  # points per nearest-search chunk (bounds the [points, n] score matrix)
PACKAGED = Path(__file__).with_name("grid_data")  # HIGGS' 2-D grids of 16, 64 and 256 points, shipped (scripts/make_grids.py)
_LOADED: dict[tuple, torch.Tensor] = {}  # grids already read or computed by this process


def nearest(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the nearest grid point of every ``x [..., d]`` (``grid [n, d]``), as int64 ``[...]``."""
    flat = x.reshape(-1, grid.shape[1])
    grid = grid.to(flat.dtype)
    half_norm = 0.5 * grid.square().sum(1)
    out = torch.empty(flat.shape[0], dtype=torch.long, device=x.device)
    for start in range(0, flat.shape[0], CHUNK):
        part = flat[start:start + CHUNK]
        out[start:start + CHUNK] = (part @ grid.T - half_norm).argmax(1)
    return out.view(x.shape[:-1])


def grid_mse(grid: torch.Tensor, samples: int = 200_000, seed: int = 1) -> float:
    """Mean squared error per coordinate of quantizing ``N(0, I_d)`` samples to their nearest grid point."""
    x = torch.randn(samples, grid.shape[1], generator=torch.Generator().manual_seed(seed))
    return (x - grid[nearest(x, grid)]).square().mean().item()


def lloyd_grid(n: int, d: int = 2, samples: int = GRID_SAMPLES, steps: int = GRID_STEPS, seed: int = 0) -> torch.Tensor:
    """An MSE-optimal ``[n, d]`` float32 grid for ``N(0, I_d)`` by stochastic Lloyd iterations (seeded, CPU)."""
    generator = torch.Generator().manual_seed(seed)
    grid = torch.randn(n, d, generator=generator)
    a, b, gamma0 = 4 * n ** (1 / d), math.pi ** 2 * n ** (-2 / d), 2.0
    for t in progress(range(steps), f"Gaussian grid of {n} points in {d}-D (computed once, then cached)", unit="step"):
        x = torch.randn(samples, d, generator=generator)
        cell = nearest(x, grid)
        counts = torch.bincount(cell, minlength=n)
        sums = torch.zeros(n, d).index_add_(0, cell, x)
        occupied = counts > 0
        step = min(1.0, gamma0 * a / (a + gamma0 * b * t))
        centroid = sums[occupied] / counts[occupied, None]
        grid[occupied] += step * (centroid - grid[occupied])
    return grid


def _checksum(grid: torch.Tensor, meta: dict) -> str:
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    digest.update(grid.contiguous().numpy().tobytes())
    return digest.hexdigest()


def gaussian_grid(n: int, d: int = 2, seed: int = 0, samples: int = GRID_SAMPLES, steps: int = GRID_STEPS) -> torch.Tensor:
    """The cached :func:`lloyd_grid` (computed and written atomically on first use; a file that fails its
    checksum is computed again and replaced); kept in memory once read."""
    meta = {"n": n, "d": d, "seed": seed, "samples": samples, "steps": steps}
    key = tuple(meta.values())
    if key not in _LOADED:
        _LOADED[key] = _cached_grid(meta)
    return _LOADED[key]


def grid_file_name(meta: dict) -> str:
    n, d, seed, samples, steps = meta.values()
    return f"gauss-d{d}-n{n}-seed{seed}-{samples}x{steps}.safetensors"


def _checked_grid(path: Path, meta: dict) -> torch.Tensor | None:
    """The grid in ``path`` when its checksum matches ``meta``, else None."""
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
        grid = load_file(str(path))["grid"]
    except Exception:  # noqa: BLE001  (an unreadable file counts as missing)
        return None
    return grid if header.get("sha256") == _checksum(grid, meta) else None


def _cached_grid(meta: dict) -> torch.Tensor:
    """The shipped grid (:data:`PACKAGED`), else the cache's, else computed and written to the cache."""
    for path in (PACKAGED / grid_file_name(meta), cache_dir() / "grids" / grid_file_name(meta)):
        if path.is_file():
            grid = _checked_grid(path, meta)
            if grid is not None:
                return grid
            log.warning("grid file %s is damaged; %s", path, "using the cache" if path.parent == PACKAGED else "computing it again")
    grid = lloyd_grid(meta["n"], meta["d"], meta["samples"], meta["steps"], meta["seed"])
    write_grid(grid, meta, cache_dir() / "grids" / grid_file_name(meta))
    return grid


def write_grid(grid: torch.Tensor, meta: dict, path: Path) -> None:
    """Write ``grid`` atomically with its checksum and per-coordinate MSE in the header."""
    header = {"sha256": _checksum(grid, meta), "mse_per_coordinate": f"{grid_mse(grid):.6f}", **{k: str(v) for k, v in meta.items()}}
    with atomic_path(path, tensors_nbytes({"grid": grid})) as tmp:
        save_file({"grid": grid}, str(tmp), metadata=header)
