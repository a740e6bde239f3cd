"""The fast Walsh-Hadamard transform (HIGGS / AQUA-KV spec §3.4, step 3).

``fwht(x)`` multiplies the last dimension (a power of two, ``g``) by the unnormalised Sylvester matrix
``H_g`` (entries +-1, ``H_g H_g = g I``) in ``log2(g)`` butterfly stages, ``O(g log g)`` per row instead
of a ``g x g`` product. ``H_g`` is symmetric, so the inverse is ``fwht(x) / g``.
"""

import torch


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def fwht(x: torch.Tensor) -> torch.Tensor:
    """``x @ H_g`` over the last dimension ``g`` (a power of two), in ``x``'s dtype."""
    g = x.shape[-1]
    if not is_power_of_two(g):
        raise ValueError(f"the Walsh-Hadamard transform needs a power-of-two length, got {g}")
    lead = x.shape[:-1]
    y = x.reshape(-1, g)
    h = 1
    while h < g:  # stage: pairs (i, i + h) within blocks of 2h become (a + b, a - b)
        pairs = y.view(-1, g // (2 * h), 2, h)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2).view(-1, g)
        h *= 2
    return y.view(*lead, g)


def grouped(x: torch.Tensor, group: int) -> tuple[torch.Tensor, int]:
    """``x [..., D]`` zero-padded to ``D' = ceil(D / group) * group`` and split into ``[..., D' / group, group]``
    (spec §3.4 step 1); returns the groups and ``D``."""
    d = x.shape[-1]
    pad = (-d) % group
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, group), d
