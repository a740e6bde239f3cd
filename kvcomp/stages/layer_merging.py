"""Groups of adjacent layers that share a CSR dictionary (spec ``seed-003-csr.md`` §2.5, C7).

The distribution of a layer's l2-normalised K (or V) vectors is compared with another layer's by the
Jensen-Shannon divergence (log 2) of their 200 x 200 histograms in a 2-D PCA fitted jointly on both
layers' vectors, averaged over KV heads. Layers are grouped greedily from the first: a layer joins the
current group while (Eq. 6) its JSD to every member is <= ``delta1`` and (Eq. 7) the JSDs of adjacent
members, summed over the grown group, stay <= ``delta2``.
"""

from __future__ import annotations

import torch

from kvcomp.stages.sparse_coding import normalize_rows

# The groups the paper uses for every 32-layer model it tests (Llama-2-7B-chat, Llama-3-8B-Instruct,
# Baichuan2-7B), after hand adjustment of the automatic result (§2.5).
PAPER_GROUPS = {
    "key": [[0], [1], [2], [3, 4, 5], [6, 7, 8, 9], [10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 20, 21],
            [22, 23, 24, 25], [26, 27, 28, 29], [30, 31]],
    "value": [[0], [1], [2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15, 16, 17, 18, 19],
              [20, 21, 22, 23, 24, 25], [26, 27, 28, 29, 30, 31]],
}


def _histogram(points: torch.Tensor, low: torch.Tensor, high: torch.Tensor, bins: int) -> torch.Tensor:
    cells = ((points - low) / (high - low).clamp_min(1e-12) * bins).long().clamp(0, bins - 1)
    counts = torch.bincount(cells[:, 0] * bins + cells[:, 1], minlength=bins * bins).double()
    return counts / counts.sum()


def jensen_shannon(p: torch.Tensor, q: torch.Tensor) -> float:
    """JSD (log 2, in [0, 1]) of two discrete distributions."""
    m = 0.5 * (p + q)

    def kl(a):
        mask = a > 0
        return float((a[mask] * (a[mask] / m[mask]).log2()).sum())

    return 0.5 * kl(p) + 0.5 * kl(q)


def layer_divergence(a: torch.Tensor, b: torch.Tensor, bins: int = 200) -> float:
    """Mean over heads of the JSD between two layers' vectors ``[H, M, d]`` (module docstring)."""
    values = []
    for x, y in zip(normalize_rows(a.float()), normalize_rows(b.float())):
        joint = torch.cat([x, y])
        mean = joint.mean(0)
        _, _, v = torch.linalg.svd(joint - mean, full_matrices=False)
        px, py = (x - mean) @ v[:2].T, (y - mean) @ v[:2].T
        both = torch.cat([px, py])
        low, high = both.min(0).values, both.max(0).values
        values.append(jensen_shannon(_histogram(px, low, high, bins), _histogram(py, low, high, bins)))
    return sum(values) / len(values)


def merge_layers(layers: list[torch.Tensor], delta1: float = 0.2, delta2: float = 1.0, bins: int = 200) -> list[list[int]]:
    """Contiguous layer groups of ``layers[l] [H, M, d]`` by Eqs. 6-7 (module docstring)."""
    memo: dict[tuple[int, int], float] = {}

    def jsd(i: int, j: int) -> float:
        if (i, j) not in memo:
            memo[i, j] = layer_divergence(layers[i], layers[j], bins)
        return memo[i, j]

    groups, adjacent_sum = [[0]], 0.0
    for layer in range(1, len(layers)):
        group = groups[-1]
        step = jsd(layer - 1, layer)
        if adjacent_sum + step <= delta2 and all(jsd(m, layer) <= delta1 for m in group):
            group.append(layer)
            adjacent_sum += step
        else:
            groups.append([layer])
            adjacent_sum = 0.0
    return groups
