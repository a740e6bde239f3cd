"""NeuralDict (CSR, spec ``seed-003-csr.md`` §2.6, §5.2, Alg. 1): learn dictionaries of unit atoms for
matching pursuit by gradient descent through the unrolled pursuit.

A dictionary is the weight of a bias-free linear layer (here ``atoms [N, d]``, one atom per row). Its forward
pass runs ``s`` MP steps: the picked indices are constants (``argmax`` under ``no_grad``), the coefficients
``c_g = <R_{g-1}, d_{i_g}>`` and the reconstruction stay in the autograd graph. The loss (Eq. 11) is

    L = L_MSE + beta * L_div,   L_div = ||I_N - D^T D||_F^2 / N^2   (Eq. 10),
    beta = min(beta_scale * L_MSE / L_div, beta_cap)  from the previous step's detached losses,

and every optimizer step is followed by ``ReNorm`` (Eq. 9: each atom divided by its norm). Training vectors
are l2-normalised (C5), so ``L_MSE`` is the mean relative squared error. Initialisation: k-means on the
normalised vectors (N centroids), renormalised. Adam with a cosine learning rate from ``lr`` to
``lr_final``; a share of the vectors is held out and the dictionary with the lowest held-out relative
MSE is kept (early stop after ``patience`` epochs without improvement).

:func:`train_dictionaries` trains ``G`` independent dictionaries at once (one per KV head, C4), each on its
own ``[M, d]`` vectors.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from kvcomp.progress import progress_bar
from kvcomp.stages.kmeans import KMeansSettings, weighted_kmeans
from kvcomp.stages.sparse_coding import matching_pursuit, normalize_rows, reconstruct

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DictTraining:
    atoms: int = 256
    sparsity: int = 8  # MP steps in the training forward pass (the paper: 8 for keys, 4 for values)
    epochs: int = 30
    batch_size: int = 4096
    lr: float = 1e-3
    lr_final: float = 1e-4
    diversity: bool = True  # the L_div term (Table 6 ablates it)
    beta_scale: float = 0.1
    beta_cap: float = 1.0
    kmeans_iters: int = 20
    heldout_fraction: float = 0.05
    patience: int = 3
    seed: int = 0


@dataclass
class TrainedDictionaries:
    """``atoms [G, N, d]`` (unit rows); ``heldout_mse``: the kept dictionaries' held-out relative MSE ``[G]``;
    ``history``: mean held-out relative MSE after each epoch (index 0: the k-means initialisation)."""

    atoms: torch.Tensor
    heldout_mse: torch.Tensor
    history: list[float] = field(default_factory=list)
    seconds: float = 0.0


def diversity_loss(atoms: torch.Tensor) -> torch.Tensor:
    """``||I - D^T D||_F^2 / N^2`` (Eq. 10) per dictionary of ``atoms [G, N, d]`` -> ``[G]``."""
    n = atoms.shape[1]
    gram = atoms @ atoms.transpose(1, 2)
    return (torch.eye(n, device=atoms.device) - gram).square().sum((1, 2)) / n**2


def pursuit_loss(x: torch.Tensor, atoms: torch.Tensor, s: int) -> torch.Tensor:
    """Mean ``||x - x_hat||^2`` per dictionary ``[G]`` of ``s`` MP steps, differentiable in ``atoms`` (indices
    detached, coefficients and reconstruction not)."""
    residual = x
    for _ in range(s):
        with torch.no_grad():
            index = (residual @ atoms.transpose(1, 2)).abs().argmax(-1)
        picked = atoms.gather(1, index[..., None].expand(-1, -1, atoms.shape[-1]))
        residual = residual - (residual * picked).sum(-1, keepdim=True) * picked
    return residual.square().sum(-1).mean(-1)


@torch.no_grad()
def relative_mse(x: torch.Tensor, atoms: torch.Tensor, s: int, chunk: int = 16384) -> torch.Tensor:
    """Mean ``||x - x_hat||^2 / ||x||^2`` of ``s`` MP steps per dictionary ``[G]`` (``x [G, M, d]``)."""
    total = torch.zeros(x.shape[0], device=x.device)
    for start in range(0, x.shape[1], chunk):
        part = x[:, start:start + chunk].float()
        hat = reconstruct(*matching_pursuit(part, atoms, s), atoms)
        total += ((part - hat).square().sum(-1) / part.square().sum(-1).clamp_min(1e-12)).sum(-1)
    return total / x.shape[1]


def train_dictionaries(vectors: torch.Tensor, settings: DictTraining, label: str = "") -> TrainedDictionaries:
    """Train one dictionary per ``vectors[g] [M, d]`` (module docstring); reports progress over epochs and
    logs a summary."""
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(settings.seed)
    x = normalize_rows(vectors.float())
    order = torch.randperm(x.shape[1], generator=generator).to(x.device)
    held = max(1, int(round(settings.heldout_fraction * x.shape[1])))
    heldout, train = x[:, order[:held]], x[:, order[held:]]
    centroids, _, _ = weighted_kmeans(train, torch.ones(train.shape[:2], device=x.device), settings.atoms,
                                      KMeansSettings(iters=settings.kmeans_iters, seed=settings.seed))
    atoms = torch.nn.Parameter(normalize_rows(centroids))
    best = atoms.detach().clone()
    best_mse = relative_mse(heldout, best, settings.sparsity)
    history = [float(best_mse.mean())]
    optimizer = torch.optim.Adam([atoms], lr=settings.lr)
    steps_per_epoch = math.ceil(train.shape[1] / settings.batch_size)
    total_steps = settings.epochs * steps_per_epoch
    beta = None
    stale, step = 0, 0
    bar = progress_bar(settings.epochs, f"NeuralDict {label}", "epoch")
    for epoch in range(1, settings.epochs + 1):
        perm = torch.randperm(train.shape[1], generator=generator).to(x.device)
        for first in range(0, train.shape[1], settings.batch_size):
            lr = settings.lr_final + 0.5 * (settings.lr - settings.lr_final) * (1 + math.cos(math.pi * step / total_steps))
            for group in optimizer.param_groups:
                group["lr"] = lr
            mse = pursuit_loss(train[:, perm[first:first + settings.batch_size]], atoms, settings.sparsity)
            loss = mse.sum()
            if settings.diversity:
                div = diversity_loss(atoms)
                ratio = (settings.beta_scale * mse.detach() / div.detach().clamp_min(1e-12)).clamp_max(settings.beta_cap)
                loss = loss + ((ratio if beta is None else beta) * div).sum()  # the first step: its own ratio
                beta = ratio
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                atoms.copy_(normalize_rows(atoms))  # ReNorm (Eq. 9)
            step += 1
        mse_now = relative_mse(heldout, atoms.detach(), settings.sparsity)
        history.append(float(mse_now.mean()))
        improved = mse_now < best_mse
        best = torch.where(improved[:, None, None], atoms.detach(), best)
        best_mse = torch.minimum(best_mse, mse_now)
        stale = 0 if bool(improved.any()) else stale + 1
        bar.set_postfix_str(f"held-out MSE {float(best_mse.mean()):.4f}")
        bar.update(1)
        if stale >= settings.patience:
            break
    bar.close()
    seconds = time.perf_counter() - start
    log.info("NeuralDict %s: %d x %d atoms of %d dims on %d vectors each, s=%d, %d epochs in %.0fs; held-out "
             "relative MSE %.4f (k-means) -> %.4f", label, x.shape[0], settings.atoms, x.shape[-1], train.shape[1],
             settings.sparsity, len(history) - 1, seconds, history[0], float(best_mse.mean()))
    return TrainedDictionaries(best, best_mse, history, seconds)
