"""95 % intervals of perplexity rows: a seeded bootstrap over the evaluated windows (Efron & Tibshirani 1993, the
percentile interval), alone and paired with the uncompressed reference on the same windows.

A perplexity row keeps each window's summed next-token NLL (``nll_<protocol>``, one float per window) and its
scored tokens (``tokens_per_window``). Resampling windows with replacement ``B`` times gives
``ppl* = exp(sum NLL* / sum tokens*)``; the 2.5th and 97.5th percentiles are ``ppl_<protocol>_ci95``. Paired with the
reference row of the same windows (the same resampled windows for both), ``ppl*_codec / ppl*_reference - 1`` gives
``ppl_<protocol>_vs_reference_ci95``: the interval of the relative change, which excludes 0 when the change is
significant at the 5 % level (two-sided).
"""

from __future__ import annotations

import math

import torch

BOOTSTRAP_SAMPLES = 2000
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


def pair_with_reference(rows: list[dict]) -> list[dict]:
    """``rows`` with ``ppl_<protocol>_vs_reference_ci95`` added to each compressed row whose reference row (one with
    a ``reference_key``, of the same benchmark label: the same windows) kept per-window NLLs of that protocol."""
    references = {row["benchmark"]: row for row in rows if row.get("reference_key") and "benchmark" in row}
    out = []
    for row in rows:
        reference = references.get(row.get("benchmark")) if not row.get("reference_key") else None
        paired = {}
        if reference is not None and row.get("tokens_per_window") == reference.get("tokens_per_window"):
            for key in [k for k in row if k.startswith("nll_") and isinstance(row[k], list)]:
                if isinstance(reference.get(key), list) and len(reference[key]) == len(row[key]):
                    protocol = key.removeprefix("nll_")
                    paired[f"ppl_{protocol}_vs_reference_ci95"] = paired_change_interval(
                        row[key], reference[key], row["tokens_per_window"])
        out.append({**row, **paired})
    return out
