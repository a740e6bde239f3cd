"""kvtc's group quantizer types and DP bit allocation (kvcomp.stages.bit_allocation), against brute force."""

import pytest
import torch

from kvcomp.stages.bit_allocation import Plan, allocate, group_cost, quantize_group


def _brute_force(p, budget, sizes, kinds):
    """The least error over every cover of [0, r) by contiguous groups of allowed sizes and types."""
    r, best = p.shape[1], (float("inf"), None)

    def covers(start):
        if start == r:
            yield []
            return
        for size in sizes:
            if start + size <= r:
                for kind in kinds:
                    for rest in covers(start + size):
                        yield [(start, start + size, kind), *rest]

    for groups in covers(0):
        plan = Plan(tuple(groups), 0.0)
        if plan.bits <= budget:
            error = (plan.apply(p).double() - p.double()).square().sum().item()
            best = min(best, (error, plan.groups), key=lambda t: t[0])
    return best


@pytest.mark.parametrize("budget", [0, 34, 40, 76, 120, 200])
def test_allocation_is_optimal_and_within_budget(budget):
    torch.manual_seed(0)
    p = torch.randn(50, 6) * torch.tensor([8.0, 5.0, 3.0, 1.0, 0.5, 0.2])  # decaying PCA spectrum
    sizes, kinds = (1, 2, 3), ("none", "int2", "int4", "fp8")
    plan = allocate(p, budget, sizes, kinds)
    expected, _ = _brute_force(p, budget, sizes, kinds)
    assert plan.bits <= budget
    assert [g[1] for g in plan.groups][-1] == 6 and all(a[1] == b[0] for a, b in zip(plan.groups, plan.groups[1:]))
    assert plan.error == pytest.approx(expected, rel=1e-6)
    assert (plan.apply(p).double() - p.double()).square().sum().item() == pytest.approx(plan.error, rel=1e-6)


def test_more_bits_never_hurt_and_zero_bits_drop_everything():
    p = torch.randn(64, 40) * torch.linspace(4, 0.1, 40)
    errors = [allocate(p, budget, (1, 16)).error for budget in (0, 64, 128, 256, 512)]
    assert errors[0] == pytest.approx(p.double().square().sum().item())
    assert all(a >= b for a, b in zip(errors, errors[1:])) and errors[-1] < 0.05 * errors[0]


def test_quantizer_types():
    x = torch.randn(20, 16) * 3
    errors = {k: (quantize_group(x, k) - x).square().mean().item() for k in ("none", "int2", "int4", "fp8")}
    assert errors["none"] > errors["int2"] > errors["int4"] > errors["fp8"]
    assert group_cost(16, "int4") == 16 * 4 + 32 and group_cost(64, "none") == 0
    constant = torch.full((3, 4), 2.5)
    torch.testing.assert_close(quantize_group(constant, "int2"), constant)  # zero range: exact


def test_block_deltas_equal_one_group_at_a_time():
    from kvcomp.stages.bit_allocation import block_deltas

    p = torch.randn(30, 20).double()
    for size, kind in ((1, "int4"), (4, "int2"), (7, "fp8"), (3, "none")):
        fast = block_deltas(p, size, kind, chunk_values=100)  # several chunks
        for j in range(20 - size + 1):
            block = p[:, j:j + size]
            slow = (quantize_group(block, kind).double() - block).square().sum() - block.square().sum()
            assert fast[j].item() == pytest.approx(0.0 if kind == "none" else slow.item(), rel=1e-9, abs=1e-9)
