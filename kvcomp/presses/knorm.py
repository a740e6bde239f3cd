"""Key-norm eviction (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression";
kvpress's ``KnormPress``): keys with a low L2 norm draw high attention, so each KV head keeps its lowest-norm keys,
``score = -||k||``."""

from __future__ import annotations

import torch

from kvcomp.presses.base import Prefill, Press, register


@register
class KnormPress(Press):
    name = "knorm"
    reads_queries = False
    decodes = True

    def scores(self, prefill: Prefill) -> torch.Tensor:
        return -prefill.keys.float().norm(dim=-1)
