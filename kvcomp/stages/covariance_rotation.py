"""Covariance-aware orthogonal rotations (OSCAR, Zhou et al. 2026, arXiv 2605.17757, §3; the authors'
``rotation/compute_kv_rotation.py``, methods ``qqt`` / ``sst``, composition ``r_h_pbr``).

Rows ``x`` (one token's head) are rotated ``x R`` before a per-token quantizer and rotated back ``x_hat R^T``
after it. ``R`` is built from a target covariance ``C`` that weighs the directions of ``x`` by what attention
does with them:

- keys, the second moment of the queries, ``C_Q = E[q q^T]`` (post-RoPE, over the KV head's query group;
  :func:`kvcomp.calibration.queries.query_moments`):
  a key error ``e`` moves the logits by ``q^T e``, of mean square ``e^T C_Q e``, so that
  ``||Q K^T - Q K_hat^T||_F^2 = tr(R^T C_Q R E_K)`` with ``E_K`` the covariance of the rotated keys' error;
- values, :func:`score_weighted_covariance`, ``C_S = E_t[w_t v_t v_t^T]`` with ``w_t = k_t^T C_Q k_t``
  normalised to mean 1: a value counts as much as its key's expected squared logit.

:func:`covariance_rotation` composes ``R = U H P``: ``U`` the eigenvectors of ``C`` (``U^T C U = Λ`` diagonal: the
errors of the coordinates weigh independently), ``H`` the orthonormal Sylvester-Hadamard matrix (``H^T Λ H`` has
every diagonal entry ``tr(C) / d``: no coordinate carries more of the attention metric than another, and
outliers are spread), and ``P`` the reference's bit-reversal permutation ``P_br`` of the columns of ``U H``:
column ``order[i]``, ``order`` ranking ``U``'s columns by eigenvalue (largest first), goes to position
``bitrev(i)``, so that the ``2^k`` first-ranked columns fall in distinct quantizer groups of ``d / 2^k`` channels
(with one group per row, OSCAR's default, it changes nothing the quantizer sees). Everything is computed in
float64, as the reference does.
"""

from __future__ import annotations

import math

import torch

from kvcomp.stages.hadamard import fwht, is_power_of_two


def score_weighted_covariance(values: torch.Tensor, keys: torch.Tensor, query_moment: torch.Tensor) -> torch.Tensor:
    """OSCAR's value target per KV head: ``E_t[w_t v_t v_t^T]``, ``w_t = k_t^T C_Q k_t / mean_t(k_t^T C_Q k_t)``.

    ``values``, ``keys`` ``[samples, heads, tokens, d]`` (keys as attention meets them, post-RoPE), ``query_moment``
    ``C_Q [heads, d, d]``; returns ``[heads, d, d]`` float64."""
    k, v, c = keys.double(), values.double(), query_moment.double()
    weights = torch.einsum("shtd,hde,shte->sht", k, c, k)
    weights = weights / weights.mean(dim=(0, 2), keepdim=True).clamp_min(1e-12)
    n = v.shape[0] * v.shape[2]
    return torch.einsum("sht,shtd,shte->hde", weights, v, v) / n


def hadamard_matrix(d: int) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix ``H_d / sqrt(d)`` (float64; ``d`` a power of two)."""
    return fwht(torch.eye(d, dtype=torch.float64)) / math.sqrt(d)


def bit_reversal(d: int) -> torch.Tensor:
    """``bitrev(i)`` for ``i < d`` (a power of two): ``i``'s ``log2(d)`` bits in reverse order."""
    bits = d.bit_length() - 1
    return torch.tensor([int(format(i, f"0{bits}b")[::-1], 2) if bits else 0 for i in range(d)])


def spread_permutation(eigenvalues: torch.Tensor) -> torch.Tensor:
    """Per row of ``eigenvalues [G, d]``, ``perm`` with ``perm[bitrev(i)]`` the index of the ``i``-th largest: the
    columns ``M[:, perm]`` of a matrix ``M`` are ``M P``."""
    order = torch.argsort(eigenvalues, dim=-1, descending=True)
    perm = torch.empty_like(order)
    perm[:, bit_reversal(eigenvalues.shape[-1]).to(order.device)] = order
    return perm


def covariance_rotation(covariance: torch.Tensor) -> torch.Tensor:
    """OSCAR's ``R = U H P`` of each symmetric ``covariance [G, d, d]`` (``d`` a power of two): ``[G, d, d]``
    float64, orthogonal, applied to rows as ``x R``."""
    d = covariance.shape[-1]
    if not is_power_of_two(d):
        raise ValueError(f"a covariance rotation needs a power-of-two dimension (its Hadamard factor), got {d}")
    c = covariance.double()
    eigenvalues, eigenvectors = torch.linalg.eigh((c + c.transpose(-1, -2)) / 2)
    mixed = eigenvectors @ hadamard_matrix(d).to(c.device)
    perm = spread_permutation(eigenvalues)
    return mixed.gather(-1, perm[:, None, :].expand_as(mixed))
