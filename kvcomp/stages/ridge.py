"""Closed-form ridge regression with a bias, and reduced-rank regression (AQUA-KV spec §3.3).

With ``X~ = [X, 1]``, the normal equations ``H = X~^T X~`` and ``C = X~^T Y`` are accumulated in chunks
(float64); the fit is ``W = (H + lambda mean|diag H| I)^-1 C`` with ``lambda = damping`` (1e-3 in the
paper; the bias row is damped too), ``A = W[:-1]``, ``b = W[-1]``. ``damping = 0`` solves with the
pseudo-inverse (ordinary least squares). ``basis="centred"`` (not the reference's) scales ``lambda`` by the mean
diagonal of the inputs' centred covariance ``X^T X - N mu mu^T`` instead: inputs on a large constant offset
(Qwen's keys) otherwise get a damping set by the offset, not by their spread. Reduced rank ``r`` (spec Table C) keeps the fit's projection on
the top ``r`` principal directions of its own predictions ``Y_hat = X~ W``: ``W_r = W V_r V_r^T`` with
``V_r`` the top eigenvectors of ``W^T H W``, stored as the factors ``W V_r`` and ``V_r^T``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

CHUNK = 4096
DAMPING_BASES = ("uncentred", "centred")


@dataclass
class LinearPredictor:
    """``y = x A + b`` (``weight`` ``[d_in, d_out]``), or reduced rank ``y = (x A + b) U`` (``weight``
    ``[d_in, r]``, ``bias`` ``[r]``, ``up`` ``[r, d_out]``). Computes in float32."""

    weight: torch.Tensor
    bias: torch.Tensor
    up: torch.Tensor | None = None
    on_device: dict = field(default_factory=dict, repr=False, compare=False)  # float32 copies by device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.device not in self.on_device:  # the layer's device: layers may live on several GPUs
            self.on_device[x.device] = tuple(None if t is None else t.to(x.device, torch.float32)
                                             for t in (self.weight, self.bias, self.up))
        weight, bias, up = self.on_device[x.device]
        y = torch.addmm(bias, x.reshape(-1, x.shape[-1]).float(), weight)
        if up is not None:
            y = y @ up
        return y.view(*x.shape[:-1], y.shape[-1])

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"weight": self.weight, "bias": self.bias}
        return out if self.up is None else {**out, "up": self.up}

    def to(self, dtype: torch.dtype) -> "LinearPredictor":
        return LinearPredictor(*(None if t is None else t.to(dtype) for t in (self.weight, self.bias, self.up)))

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.tensors().values())


class RidgeFit:
    """Accumulates ``H`` and ``C`` over batches of rows ``x [N, d_in]``, ``y [N, d_out]``; :meth:`solve` fits."""

    def __init__(self, d_in: int, d_out: int, device: torch.device | str = "cpu"):
        self.h = torch.zeros(d_in + 1, d_in + 1, dtype=torch.float64, device=device)
        self.c = torch.zeros(d_in + 1, d_out, dtype=torch.float64, device=device)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for start in range(0, x.shape[0], CHUNK):
            xs = x[start:start + CHUNK].to(self.h)
            xs = torch.cat([xs, torch.ones_like(xs[:, :1])], dim=1)
            self.h += xs.T @ xs
            self.c += xs.T @ y[start:start + CHUNK].to(self.c)

    def solve(self, damping: float = 1e-3, rank: int = 0, basis: str = "uncentred") -> LinearPredictor:
        """The damped least-squares predictor (``rank > 0``: reduced-rank; float32 factors)."""
        h = self.h
        if damping > 0:
            h = h + damping * self.damping_scale(basis) * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
            w = torch.linalg.solve(h, self.c)
        else:
            w = torch.linalg.pinv(h) @ self.c
        if 0 < rank < w.shape[1]:
            _, vectors = torch.linalg.eigh(w.T @ self.h @ w)  # ascending eigenvalues
            top = vectors[:, -rank:]
            w, up = w @ top, top.T.float()
            return LinearPredictor(w[:-1].float(), w[-1].float(), up)
        return LinearPredictor(w[:-1].float(), w[-1].float())

    def damping_scale(self, basis: str) -> torch.Tensor:
        """``mean|diag H|`` (uncentred, the bias row included) or the inputs' mean centred variance times ``N``."""
        if basis == "uncentred":
            return self.h.diagonal().abs().mean()
        n, sums = self.h[-1, -1].clamp_min(1), self.h[:-1, -1]
        return (self.h.diagonal()[:-1] - sums.square() / n).clamp_min(0).mean()
