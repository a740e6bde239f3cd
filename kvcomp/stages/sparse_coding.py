"""Sparse coding over dictionaries of unit-norm atoms (CSR, spec ``seed-003-csr.md`` §2.2, §5.3-5.4).

Every function works on ``G`` independent dictionaries at once (batch x KV heads): ``atoms [G, N, d]`` holds
one atom per row (the paper's ``D = [d_1 .. d_N]`` transposed) and ``x [G, T, d]`` the vectors coded against
dictionary ``g``. A code is ``s`` pairs ``(index [G, T, s] int64, coefficient [G, T, s] float32)``; an
index may repeat (MP can pick an atom twice, C1) and the vector it stands for is ``sum_g c_g d_{i_g}``.

- :func:`matching_pursuit` (Eqs. 2-4): ``s`` greedy steps, each picking ``argmax_n |<R, d_n>|`` and taking
  the *signed* correlation as the coefficient. With unit atoms ``||x - x_hat||^2 = ||x||^2 - sum c^2``.
  The Gram form updates the correlations with the Gram matrix ``G = D^T D`` (``a -= c G[i]``, §5.3) instead
  of recomputing ``R D``: the same picks, O(N) instead of O(N d) per step.
- :func:`orthogonal_matching_pursuit` (OMP, the C2 ablation): the same picks, coefficients refitted by least
  squares on the atoms chosen so far after every step.
- :func:`reconstruct` (Eq. 12, ``X~ = D r``) as a gather-sum over the ``s`` pairs, and
  :func:`sparse_weighted_sum` (§5.4's value trick): ``sum_t p_t x_hat_t = D u`` with
  ``u[n] = sum_{t, g: i_{t,g} = n} p_t c_{t,g}``, a scatter-add into an N-vector and one GEMV per query.
"""

from __future__ import annotations

import torch

from kvcomp.stages.ranges import stable_norm


def _rows(atoms: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``atoms [G, N, d]`` rows picked by ``index [G, T]`` -> ``[G, T, d]``."""
    return atoms.gather(1, index[..., None].expand(-1, -1, atoms.shape[-1]))


def matching_pursuit(x: torch.Tensor, atoms: torch.Tensor, s: int, gram: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``s`` MP steps for ``x [G, T, d]`` over ``atoms [G, N, d]``: ``(index, coefficient)``, each ``[G, T, s]``.
    ``gram=None`` uses the Gram update when the steps outnumber the atoms (``T s > N``: its ``N x N`` set-up pays)."""
    if gram is None:
        gram = x.shape[1] * s > atoms.shape[1]
    x, atoms = x.float(), atoms.float()
    correlations = x @ atoms.transpose(1, 2)  # [G, T, N]
    gram_matrix = atoms @ atoms.transpose(1, 2) if gram else None
    residual = None if gram else x.clone()
    indices, coefficients = [], []
    for _ in range(s):
        index = correlations.abs().argmax(-1)
        c = correlations.gather(-1, index[..., None]).squeeze(-1)
        indices.append(index)
        coefficients.append(c)
        if gram:  # <R - c d_i, d_n> = a_n - c <d_i, d_n>
            correlations = correlations - c[..., None] * gram_matrix.gather(1, index[..., None].expand(-1, -1, atoms.shape[1]))
        else:
            residual = residual - c[..., None] * _rows(atoms, index)
            correlations = residual @ atoms.transpose(1, 2)
    return torch.stack(indices, -1), torch.stack(coefficients, -1)


def orthogonal_matching_pursuit(x: torch.Tensor, atoms: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """OMP (C2 ablation): picks like MP, then least-squares coefficients over every atom picked so far."""
    x, atoms = x.float(), atoms.float()
    residual, indices, coefficients = x.clone(), [], None
    eye = torch.eye(s, device=x.device)
    for step in range(s):
        indices.append((residual @ atoms.transpose(1, 2)).abs().argmax(-1))
        chosen = torch.stack([_rows(atoms, i) for i in indices], 2)  # [G, T, k, d]
        normal = chosen @ chosen.transpose(-1, -2) + 1e-6 * eye[: step + 1, : step + 1]
        coefficients = torch.linalg.solve(normal, (chosen @ x[..., None]))[..., 0]  # [G, T, k]
        residual = x - (coefficients[..., None] * chosen).sum(2)
    return torch.stack(indices, -1), coefficients


def reconstruct(index: torch.Tensor, coefficient: torch.Tensor, atoms: torch.Tensor) -> torch.Tensor:
    """``x_hat = sum_g c_g d_{i_g}`` (Eq. 12) for codes ``[G, T, s]`` over ``atoms [G, N, d]`` -> float32 ``[G, T, d]``."""
    g, t, s = index.shape
    picked = _rows(atoms.float(), index.reshape(g, t * s).long()).view(g, t, s, -1)
    return (coefficient.float()[..., None] * picked).sum(2)


def sparse_weighted_sum(weights: torch.Tensor, index: torch.Tensor, coefficient: torch.Tensor,
                        atoms: torch.Tensor) -> torch.Tensor:
    """``sum_t weights[q, t] x_hat_t`` without reconstructing ``x_hat`` (§5.4): ``weights [G, Q, T]`` (attention
    probabilities), codes ``[G, T, s]`` -> float32 ``[G, Q, d]`` as ``D u``."""
    g, q, t = weights.shape
    s = index.shape[-1]
    terms = (weights.float()[..., None] * coefficient.float()[:, None]).reshape(g, q, t * s)
    u = torch.zeros(g, q, atoms.shape[1], device=weights.device)
    u.scatter_add_(-1, index.reshape(g, 1, t * s).long().expand(g, q, -1), terms)
    return u @ atoms.float()


def normalize_rows(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """``x / ||x||`` along the last dim (zero rows stay zero)."""
    return x / stable_norm(x)[..., None].clamp_min(eps)
