"""Analyses of K/V activations and projection weights (the TemporalKV information-theoretic study)."""

from kvcomp.analysis.kv_statistics import (
    EntropyEstimate,
    adjacent_channel_correlation,
    chunk_vectors,
    discrete_entropy_bits,
    effective_rank,
    fisher_by_position,
    gaussian_entropy_per_float,
    joint_entropy_per_float,
    lag_correlation,
    quantize,
    standardize,
)

__all__ = [
    "EntropyEstimate",
    "adjacent_channel_correlation",
    "chunk_vectors",
    "discrete_entropy_bits",
    "effective_rank",
    "fisher_by_position",
    "gaussian_entropy_per_float",
    "joint_entropy_per_float",
    "lag_correlation",
    "quantize",
    "standardize",
]
