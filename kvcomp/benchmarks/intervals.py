"""95 % intervals of benchmark rows, alone and paired with the uncompressed reference on the same data.

**Perplexity**: a seeded bootstrap over the evaluated windows (Efron & Tibshirani 1993, the percentile interval).

A perplexity row keeps each window's summed next-token NLL (``nll_<protocol>``, one float per window) and its
scored tokens (``tokens_per_window``). Resampling windows with replacement ``B`` times gives
``ppl* = exp(sum NLL* / sum tokens*)``; the 2.5th and 97.5th percentiles are ``ppl_<protocol>_ci95``. Paired with the
reference row of the same windows (the same resampled windows for both), ``ppl*_codec / ppl*_reference - 1`` gives
``ppl_<protocol>_vs_reference_ci95``: the interval of the relative change, which excludes 0 when the change is
significant at the 5 % level (two-sided).

**Accuracies** (RULER): ``acc_<task>_ci95`` and ``acc_avg_ci95`` are Wilson score intervals (Wilson 1927) of the mean
score, each sample's score (a share in [0, 1], x100) counted as one trial; a compressed row's
``acc_avg_vs_reference_ci95`` is the paired bootstrap interval of its mean change in points, the samples of every
task pooled and resampled together (so that one sample per task still gives an interval).
"""

from __future__ import annotations

import math

import torch

BOOTSTRAP_SAMPLES = 2000
Z95 = 1.959963984540054  # the standard normal's 97.5th percentile
SEED = 0  # the same resampled windows for every row, so that rows of one run are compared on the same draws


def _resampled(windows: int, samples: int, seed: int) -> torch.Tensor:
    """``[samples, windows]`` window indices drawn with replacement."""
    return torch.randint(0, windows, (samples, windows), generator=torch.Generator().manual_seed(seed))


def _mean_nll(nll: torch.Tensor, tokens: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    return nll[draws].sum(-1) / tokens[draws].sum(-1)


def _percentiles(values: torch.Tensor) -> list[float]:
    low, high = torch.quantile(values, torch.tensor([0.025, 0.975], dtype=values.dtype)).tolist()
    return [low, high]


def ppl_interval(nll: list[float], tokens: list[int], samples: int = BOOTSTRAP_SAMPLES, seed: int = SEED) -> list[float]:
    """``[low, high]``: the 95 % bootstrap interval of the perplexity of windows with summed NLL ``nll`` over
    ``tokens`` scored tokens each."""
    nll_t, tokens_t = torch.tensor(nll, dtype=torch.float64), torch.tensor(tokens, dtype=torch.float64)
    draws = _resampled(len(nll), samples, seed)
    return [math.exp(x) for x in _percentiles(_mean_nll(nll_t, tokens_t, draws))]


def paired_change_interval(nll: list[float], reference_nll: list[float], tokens: list[int],
                           samples: int = BOOTSTRAP_SAMPLES, seed: int = SEED) -> list[float]:
    """``[low, high]``: the 95 % paired bootstrap interval of ``ppl / ppl_reference - 1`` on the same windows."""
    nll_t, ref_t = torch.tensor(nll, dtype=torch.float64), torch.tensor(reference_nll, dtype=torch.float64)
    tokens_t = torch.tensor(tokens, dtype=torch.float64)
    draws = _resampled(len(nll), samples, seed)
    change = torch.exp(_mean_nll(nll_t, tokens_t, draws) - _mean_nll(ref_t, tokens_t, draws)) - 1
    return _percentiles(change)


def wilson_interval(accuracy: float, trials: int) -> list[float]:
    """``[low, high]`` (0-100): the 95 % Wilson score interval of a mean score ``accuracy`` (0-100) over ``trials``."""
    p, n, z2 = accuracy / 100, trials, Z95**2
    centre, half = (p + z2 / (2 * n)) / (1 + z2 / n), Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return [100 * max(0.0, centre - half), 100 * min(1.0, centre + half)]


def paired_mean_change_interval(scores: list[float], reference: list[float], samples: int = BOOTSTRAP_SAMPLES,
                                seed: int = SEED) -> list[float]:
    """``[low, high]``: the 95 % paired bootstrap interval of ``mean(scores - reference)`` (the same items)."""
    change = torch.tensor(scores, dtype=torch.float64) - torch.tensor(reference, dtype=torch.float64)
    return _percentiles(change[_resampled(len(change), samples, seed)].mean(-1))


def _pooled_scores(row: dict, tasks: list[str]) -> list[float]:
    return [score for task in tasks for score in row["scores"][task]]


def _paired(row: dict, reference: dict) -> dict:
    """The paired intervals of ``row`` against ``reference`` (rows of the same data)."""
    paired = {}
    if row.get("tokens_per_window") is not None and row.get("tokens_per_window") == reference.get("tokens_per_window"):
        for key in [k for k in row if k.startswith("nll_") and isinstance(row[k], list)]:
            if isinstance(reference.get(key), list) and len(reference[key]) == len(row[key]):
                paired[f"ppl_{key.removeprefix('nll_')}_vs_reference_ci95"] = paired_change_interval(
                    row[key], reference[key], row["tokens_per_window"])
    if isinstance(row.get("scores"), dict) and isinstance(reference.get("scores"), dict):
        tasks = [t for t in row["scores"] if len(reference["scores"].get(t, [])) == len(row["scores"][t])]
        if tasks and len(tasks) == len(row["scores"]):
            paired["acc_avg_vs_reference_ci95"] = paired_mean_change_interval(
                _pooled_scores(row, tasks), _pooled_scores(reference, tasks))
    return paired


def pair_with_reference(rows: list[dict]) -> list[dict]:
    """``rows`` with the paired intervals (``ppl_<protocol>_vs_reference_ci95``, ``acc_avg_vs_reference_ci95``) added
    to each compressed row whose reference row (one with a ``reference_key``, of the same benchmark label: the same
    windows or samples) kept the per-window NLLs or per-sample scores."""
    references = {row["benchmark"]: row for row in rows if row.get("reference_key") and "benchmark" in row}
    out = []
    for row in rows:
        reference = references.get(row.get("benchmark")) if not row.get("reference_key") else None
        out.append({**row, **(_paired(row, reference) if reference is not None else {})})
    return out
