"""Next-token distributions against the uncompressed reference, exactly over the full vocabulary (as llama.cpp's
``perplexity --kl-divergence`` judges a quantization): per token, ``KL(P_ref || P) = sum_v P_ref(v) (log P_ref(v) -
log P(v))``, whether the two argmaxes agree, and the change ``log P(x) - log P_ref(x)`` of the true next token ``x``.

The reference evaluation keeps each window's final hidden states (the output head's input, ``[windows, tokens,
hidden]``: a few MiB, where its logits would take GiB), cached with the reference rows; a compressed evaluation
recomputes the reference logits from them through the same head, a chunk of tokens at a time, beside its own. The
reference forward thus stays once per model and data, and an evaluation compared with itself gives KL exactly 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

TOKEN_CHUNK = 256  # tokens whose full-vocabulary logits are held at once (two [chunk, vocab] float tensors)


def output_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """Float logits of ``hidden`` (the decoder's final, normed states) through the model's output head, with its final
    soft-capping where the model has one (``final_logit_softcapping``): what ``model(...).logits`` holds."""
    logits = model.get_output_embeddings()(hidden).float()
    cap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


@dataclass
class WindowScores:
    """One window's scores of its predicted tokens: summed NLL; against the reference (None without one) the summed
    KL, the tokens whose argmax agrees, the summed log-probability change and every token's KL."""

    nll: float
    kld: float | None = None
    top1: int | None = None
    dlogp: float | None = None
    token_kld: torch.Tensor | None = field(default=None, repr=False)


@torch.no_grad()
def score_window(model, hidden: torch.Tensor, targets: torch.Tensor, reference: torch.Tensor | None = None) -> WindowScores:
    """Scores of the states ``hidden [T, hidden]`` predicting ``targets [T]`` (and, given the reference's states
    ``reference [T, hidden]`` of the same tokens, against it), :data:`TOKEN_CHUNK` tokens at a time."""
    nll, kld, top1, dlogp, token_kld = 0.0, 0.0, 0, 0.0, []
    for start in range(0, len(targets), TOKEN_CHUNK):
        span = slice(start, start + TOKEN_CHUNK)
        logp = F.log_softmax(output_logits(model, hidden[span]), dim=-1)
        true = targets[span, None]
        mine = logp.gather(-1, true).squeeze(-1)
        nll -= mine.double().sum().item()
        if reference is None:
            continue
        ref = F.log_softmax(output_logits(model, reference[span].to(hidden.device)), dim=-1)
        per_token = (ref.exp() * (ref - logp)).sum(-1).clamp_min(0)  # float rounding aside, KL >= 0
        token_kld.append(per_token.cpu())
        kld += per_token.double().sum().item()
        top1 += (ref.argmax(-1) == logp.argmax(-1)).sum().item()
        dlogp += (mine - ref.gather(-1, true).squeeze(-1)).double().sum().item()
    if reference is None:
        return WindowScores(nll)
    return WindowScores(nll, kld, top1, dlogp, torch.cat(token_kld))
