"""The degenerate-output gate: a compressed row whose outputs have left the reference's gets ``flag``, a line naming
each threshold it crossed, so that a broken codec never passes for a good one on its headline metric (a cache that
loops or babbles can keep a fair perplexity on most tokens, or a RULER score on short answers).

A row is flagged when, against the uncompressed reference on the same data:

- a perplexity protocol's mean KL divergence exceeds :data:`MAX_KLD_MEAN` nats per token (the next-token
  distribution no longer resembles the reference's; llama.cpp's 4-bit weight quantizations sit near 0.03), or its
  top-1 agreement falls below :data:`MIN_TOP1_AGREEMENT` (most argmaxes changed);
- a generation benchmark's mean output length leaves :data:`OUTPUT_LENGTH_RATIO` times the reference's (it stops at
  once, or never stops), or its repetition rate (:func:`~kvcomp.benchmarks.generation.repetition_rate`) exceeds
  the reference's by more than :data:`MAX_REPETITION_EXCESS` (it loops).
"""

from __future__ import annotations

MAX_KLD_MEAN = 1.0
MIN_TOP1_AGREEMENT = 0.5
OUTPUT_LENGTH_RATIO = (0.5, 2.0)
MAX_REPETITION_EXCESS = 0.25


def degenerate_reasons(row: dict) -> list[str]:
    """The thresholds ``row`` crosses (its paired metrics already added, :func:`~kvcomp.benchmarks.intervals.pair_with_reference`)."""
    reasons = []
    for key, value in row.items():
        if not isinstance(value, (int, float)):
            continue
        if key.startswith("kld_mean_") and not key.endswith("_ci95") and value > MAX_KLD_MEAN:
            reasons.append(f"{key} {value:.3g} > {MAX_KLD_MEAN}")
        elif key.startswith("top1_agreement_") and not key.endswith("_ci95") and value < MIN_TOP1_AGREEMENT:
            reasons.append(f"{key} {value:.3g} < {MIN_TOP1_AGREEMENT}")
    ratio = row.get("output_tokens_vs_reference")
    low, high = OUTPUT_LENGTH_RATIO
    if isinstance(ratio, (int, float)) and not low <= ratio <= high:
        reasons.append(f"output_tokens_vs_reference {ratio:.3g} outside [{low}, {high}]")
    excess = row.get("repetition_rate_vs_reference")
    if isinstance(excess, (int, float)) and excess > MAX_REPETITION_EXCESS:
        reasons.append(f"repetition_rate_vs_reference +{excess:.3g} > +{MAX_REPETITION_EXCESS}")
    return reasons


def flag_degenerate(rows: list[dict]) -> list[dict]:
    """``rows`` with ``flag`` (the reasons, joined by ``; ``) on each compressed row the gate stops; the reference rows
    (those with a ``reference_key``) are never flagged."""
    out = []
    for row in rows:
        reasons = [] if row.get("reference_key") else degenerate_reasons(row)
        out.append({**row, "flag": "; ".join(reasons)} if reasons else row)
    return out
