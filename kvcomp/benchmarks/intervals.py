"""95 % intervals of benchmark rows, alone and paired with the uncompressed reference on the same data.

**Perplexity**: a seeded bootstrap over the evaluated windows (Efron & Tibshirani 1993, the percentile interval).

A perplexity row keeps each window's summed next-token NLL (``nll_<protocol>``, one float per window) and its
scored tokens (``tokens_per_window``). Resampling windows with replacement ``B`` times gives
``ppl* = exp(sum NLL* / sum tokens*)``; the 2.5th and 97.5th percentiles are ``ppl_<protocol>_ci95``. Paired with the
reference row of the same windows (the same resampled windows for both), ``ppl*_codec / ppl*_reference - 1`` gives
``ppl_<protocol>_vs_reference_ci95``: the interval of the relative change, which excludes 0 when the change is
significant at the 5 % level (two-sided).

The distribution metrics against the reference (:mod:`~kvcomp.benchmarks.distribution`) are intervals over the same
draws: a per-token mean (``kld_mean``, ``top1_agreement``, ``dlogp_mean``) as ``sum over drawn windows / their
tokens`` (:func:`ratio_interval`), a quantile (``kld_median``, ``kld_p99``) of the drawn windows' tokens pooled
(:func:`quantile_interval`).

**Accuracies** (RULER): ``acc_<task>_ci95`` and ``acc_avg_ci95`` are Wilson score intervals (Wilson 1927) of the mean
score, each sample's score (a share in [0, 1], x100) counted as one trial; a compressed row's
``acc_avg_vs_reference_ci95`` is the paired bootstrap interval of its mean change in points, the samples of every
task pooled and resampled together (so that one sample per task still gives an interval); an lm-eval row's is
``score_avg_vs_reference_ci95``, over its per-doc ``scores``. The per-sample means
(the gold answer's log-probability, the repetition rate, the output length) get bootstrap intervals over samples, and
compressed rows their paired changes (``<metric>_vs_reference``, the output length's as a ratio of totals).
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


def ratio_interval(sums: list[float], counts: list[float], samples: int = BOOTSTRAP_SAMPLES, seed: int = SEED) -> list[float]:
    """``[low, high]``: the 95 % bootstrap interval of ``sum(sums) / sum(counts)`` over windows (a per-token mean:
    each window's summed value and its tokens)."""
    sums_t, counts_t = torch.tensor(sums, dtype=torch.float64), torch.tensor(counts, dtype=torch.float64)
    return _percentiles(_mean_nll(sums_t, counts_t, _resampled(len(sums), samples, seed)))


def ppl_interval(nll: list[float], tokens: list[int], samples: int = BOOTSTRAP_SAMPLES, seed: int = SEED) -> list[float]:
    """``[low, high]``: the 95 % bootstrap interval of the perplexity of windows with summed NLL ``nll`` over
    ``tokens`` scored tokens each."""
    return [math.exp(x) for x in ratio_interval(nll, tokens, samples, seed)]


def quantile_interval(values: list[torch.Tensor], q: float, samples: int = BOOTSTRAP_SAMPLES, seed: int = SEED) -> list[float]:
    """``[low, high]``: the 95 % bootstrap interval of the ``q`` quantile of per-token ``values`` (one tensor per
    window), windows resampled with their tokens (the same draws as :func:`ratio_interval`)."""
    estimates = torch.empty(samples, dtype=torch.float64)
    for i, draw in enumerate(_resampled(len(values), samples, seed).tolist()):
        estimates[i] = torch.quantile(torch.cat([values[w] for w in draw]).double(), q)
    return _percentiles(estimates)


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


def _paired(row: dict, reference: dict) -> dict:
    """The paired intervals of ``row`` against ``reference`` (rows of the same data)."""
    paired = {}
    if row.get("tokens_per_window") is not None and row.get("tokens_per_window") == reference.get("tokens_per_window"):
        for key in [k for k in row if k.startswith("nll_") and isinstance(row[k], list)]:
            if isinstance(reference.get(key), list) and len(reference[key]) == len(row[key]):
                paired[f"ppl_{key.removeprefix('nll_')}_vs_reference_ci95"] = paired_change_interval(
                    row[key], reference[key], row["tokens_per_window"])
    if _same_samples(row, reference, "scores"):
        average = "acc_avg" if "acc_avg" in row else "score_avg"  # RULER's headline, or lm-eval's
        paired[f"{average}_vs_reference_ci95"] = paired_mean_change_interval(_pooled(row, "scores"),
                                                                             _pooled(reference, "scores"))
    for name, per_sample in (("answer_logp", "answer_logps"), ("repetition_rate", "repetition_rates")):
        if _same_samples(row, reference, per_sample):
            mine, theirs = _pooled(row, per_sample), _pooled(reference, per_sample)
            paired[f"{name}_vs_reference"] = (sum(mine) - sum(theirs)) / len(mine)
            paired[f"{name}_vs_reference_ci95"] = paired_mean_change_interval(mine, theirs)
    if _same_samples(row, reference, "output_lengths") and sum(_pooled(reference, "output_lengths")) > 0:
        mine, theirs = _pooled(row, "output_lengths"), _pooled(reference, "output_lengths")
        paired["output_tokens_vs_reference"] = sum(mine) / sum(theirs)
        paired["output_tokens_vs_reference_ci95"] = ratio_interval(mine, theirs)
    return paired


def _same_samples(row: dict, reference: dict, name: str) -> bool:
    """Whether both rows hold the per-sample values ``name`` (task -> list) of the same tasks and samples."""
    mine, theirs = row.get(name), reference.get(name)
    return (isinstance(mine, dict) and isinstance(theirs, dict) and bool(mine) and mine.keys() == theirs.keys()
            and all(len(mine[t]) == len(theirs[t]) for t in mine))


def _pooled(row: dict, name: str) -> list[float]:
    return [value for values in row[name].values() for value in values]


SAMPLE_MEANS = (("answer_logp", "answer_logps"), ("repetition_rate", "repetition_rates"), ("output_tokens", "output_lengths"))


def sample_means(row: dict) -> dict:
    """A generation row's means over every sample (or doc) of its tasks of the per-sample values it holds (task ->
    list): the gold answer's mean log-probability per token (``answer_logp``), the repetition rate
    (``repetition_rate``), the output length (``output_tokens``), each with its 95 % bootstrap interval over samples
    (``_ci95``)."""
    means = {}
    for name, per_sample in SAMPLE_MEANS:
        pooled = _pooled(row, per_sample) if isinstance(row.get(per_sample), dict) else []
        if pooled:
            means |= {name: sum(pooled) / len(pooled), f"{name}_ci95": ratio_interval(pooled, [1] * len(pooled))}
    return means


def pair_with_reference(rows: list[dict]) -> list[dict]:
    """``rows`` with the paired intervals (``ppl_<protocol>_vs_reference_ci95``, ``acc_avg_vs_reference_ci95`` or
    ``score_avg_vs_reference_ci95``, the per-sample means' changes) added to each compressed row whose reference row
    (one with a ``reference_key``, of the same benchmark label: the same windows or samples) kept the per-window NLLs
    or per-sample values."""
    references = {row["benchmark"]: row for row in rows if row.get("reference_key") and "benchmark" in row}
    out = []
    for row in rows:
        reference = references.get(row.get("benchmark")) if not row.get("reference_key") else None
        out.append({**row, **(_paired(row, reference) if reference is not None else {})})
    return out
