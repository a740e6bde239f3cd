"""Weighted batched k-means against brute force, and its invariants."""

import itertools

import pytest
import torch

from kvcomp.stages.kmeans import KMeansSettings, nearest_centroid, weighted_inertia, weighted_kmeans


def brute_force_optimum(points: torch.Tensor, weights: torch.Tensor, k: int) -> float:
    """Global minimum of the weighted k-means objective over every assignment (tiny inputs only)."""
    best = float("inf")
    for labels in itertools.product(range(k), repeat=len(points)):
        labels = torch.tensor(labels)
        cost = 0.0
        for j in range(k):
            member = labels == j
            if member.any():
                w = weights[member]
                center = (w[:, None] * points[member]).sum(0) / w.sum()
                cost += float((w * (points[member] - center).square().sum(-1)).sum())
        best = min(best, cost)
    return best


def test_matches_brute_force_on_small_data():
    torch.manual_seed(1)
    centers = torch.tensor([[0.0, 0.0], [4.0, 0.0], [0.0, 5.0]])
    points = (centers.repeat_interleave(3, 0) + 0.6 * torch.randn(9, 2))[None]
    weights = torch.rand(1, 9) + 0.1
    centroids, _, _ = weighted_kmeans(points, weights, 3, KMeansSettings(seed=0))
    ours = float(weighted_inertia(points, weights, centroids))
    assert ours == pytest.approx(brute_force_optimum(points[0], weights[0], 3), rel=1e-5)


def test_weights_pull_centroids_and_are_the_weighted_mean():
    points = torch.tensor([[[0.0], [1.0], [10.0], [11.0]]])
    weights = torch.tensor([[1.0, 3.0, 1.0, 1.0]])
    centroids, assign, _ = weighted_kmeans(points, weights, 2, KMeansSettings(seed=0))
    assert sorted(centroids[0, :, 0].tolist()) == pytest.approx([0.75, 10.5])
    assert assign[0, 0] == assign[0, 1] != assign[0, 2]


def test_objective_never_increases_with_more_iterations():
    torch.manual_seed(0)
    points, weights = torch.randn(4, 300, 3), torch.rand(4, 300)
    inertia = [
        weighted_inertia(points, weights, weighted_kmeans(points, weights, 16, KMeansSettings(iters=i, tol=0))[0])
        for i in (1, 2, 4, 8, 16)
    ]
    for before, after in zip(inertia, inertia[1:]):
        assert (after <= before + 1e-4).all()
    assert (inertia[-1] < inertia[0]).all()


def test_empty_clusters_are_reseeded():
    # 6 distinct locations, heavy duplicates: k-means++ may pick duplicates; no centroid may stay empty
    torch.manual_seed(0)
    base = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    points = base[torch.tensor([0] * 50 + [1, 2, 3, 4, 5])][None, :, None]
    weights = torch.ones(1, points.shape[1])
    weights[0, :50] = 0  # the duplicated point carries no weight: its cluster has zero mass
    centroids, assign, _ = weighted_kmeans(points, weights, 6, KMeansSettings(seed=3, iters=20))
    assert torch.unique(assign[0]).numel() == 6
    assert float(weighted_inertia(points, weights, centroids)) == pytest.approx(0.0, abs=1e-8)


def test_deterministic_under_a_seed_and_batched_like_separate():
    torch.manual_seed(0)
    points, weights = torch.randn(3, 200, 2), torch.rand(3, 200)
    a = weighted_kmeans(points, weights, 8, KMeansSettings(seed=5))[0]
    b = weighted_kmeans(points, weights, 8, KMeansSettings(seed=5))[0]
    assert torch.equal(a, b)
    c = weighted_kmeans(points, weights, 8, KMeansSettings(seed=6))[0]
    assert not torch.equal(a, c)


def test_nearest_centroid_matches_cdist_in_tiles():
    torch.manual_seed(0)
    points, centroids = torch.randn(5, 333, 4), torch.randn(5, 17, 4)
    expected = torch.cdist(points, centroids).argmin(-1)
    assert torch.equal(nearest_centroid(points, centroids, tile_elements=500), expected)


def test_too_few_points_is_an_error():
    with pytest.raises(ValueError, match="at least k=8"):
        weighted_kmeans(torch.randn(1, 5, 2), torch.ones(1, 5), 8)


def test_scalar_codebooks_use_the_same_nearest_centroid():
    torch.manual_seed(0)
    points, centroids = torch.randn(4, 500, 1), torch.randn(4, 9, 1)
    expected = (points - centroids.transpose(1, 2)).abs().argmin(-1)
    assert torch.equal(nearest_centroid(points, centroids), expected)


def test_seeding_samples_proportionally_to_squared_distance():
    from kvcomp.stages.kmeans import _sample_proportional

    mass = torch.tensor([[0.0, 1.0, 3.0, 0.0]]).expand(4000, -1)
    picks = _sample_proportional(mass, torch.Generator().manual_seed(0), torch.empty(4000, 4, dtype=torch.float64))
    counts = torch.bincount(picks, minlength=4).float() / 4000
    assert counts[0] == 0 and counts[3] == 0 and abs(counts[2] - 0.75) < 0.03


def plain_seeding(points: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """k-means++ as written down: ``[C, N, d]`` distances, float64 cumulative sums (the test's oracle)."""
    rows = torch.arange(points.shape[0])
    centroids = points[rows, torch.randint(points.shape[1], (points.shape[0],), generator=generator)][:, None]
    closest = (points - centroids[:, 0, None]).square().sum(-1)
    for _ in range(1, k):
        mass = torch.where(closest.sum(-1, keepdim=True) > 0, closest, torch.ones_like(closest))
        cumulative = mass.double().cumsum(-1)
        u = torch.rand(len(rows), 1, generator=generator, dtype=torch.float64)
        pick = torch.searchsorted(cumulative, u * cumulative[:, -1:], side="right").squeeze(1).clamp_max(points.shape[1] - 1)
        centroids = torch.cat([centroids, points[rows, pick][:, None]], 1)
        closest = torch.minimum(closest, (points - centroids[:, -1, None]).square().sum(-1))
    return centroids


@pytest.mark.parametrize("dim", [1, 2, 4, 8])
def test_seeding_is_bitwise_the_plain_formulation(dim):
    """The in-place, plane-by-plane seeding picks exactly the points the plain formulation picks (so
    fitted codebooks, and every table row fitted with them, do not move), including rows whose points
    all coincide with chosen centroids (uniform draws)."""
    from kvcomp.stages.kmeans import kmeans_plus_plus

    generator = torch.Generator().manual_seed(dim)
    points = torch.randn(6, 700, dim, generator=generator) * torch.logspace(-3, 3, 6)[:, None, None]
    points[5] = points[5, :1]  # one codebook of identical points
    points[4, 300:] = points[4, :1]
    ours = kmeans_plus_plus(points, 64, torch.Generator().manual_seed(7))
    assert torch.equal(ours, plain_seeding(points, 64, torch.Generator().manual_seed(7)))


def test_converged_codebooks_stop_computing_and_the_result_is_unchanged(monkeypatch):
    """Codebooks that stopped moving are left out of later iterations: the centroids, assignment and
    iteration count are bitwise those of iterating every codebook until all have converged."""
    from kvcomp.stages import kmeans
    from kvcomp.stages.kmeans import _reseed_empty, kmeans_plus_plus

    computed = []  # codebooks in each assignment step
    monkeypatch.setattr(kmeans, "nearest_centroid", lambda p, c, *a: computed.append(len(p)) or nearest_centroid(p, c, *a))

    generator = torch.Generator().manual_seed(3)
    easy = torch.randn(3, 2, 4, generator=generator) * 8  # well separated clusters: converge in a few steps
    easy = (easy.repeat_interleave(100, 1) + 0.1 * torch.randn(3, 200, 4, generator=generator))[:, torch.randperm(200)]
    points = torch.cat([easy.repeat(1, 1, 1), torch.randn(3, 200, 4, generator=generator)])  # and 3 slow ones
    weights = torch.rand(6, 200, generator=generator)
    settings = KMeansSettings(iters=60, tol=0.0)
    centroids, assign, iterations = weighted_kmeans(points, weights, 8, settings)

    reference = kmeans_plus_plus(points, 8, torch.Generator().manual_seed(settings.seed))
    for count in range(1, settings.iters + 1):  # every codebook, every iteration
        labels = nearest_centroid(points, reference)
        sums = torch.zeros(6, 8, 4).scatter_add_(1, labels.unsqueeze(-1).expand(-1, -1, 4), points * weights[..., None])
        mass = torch.zeros(6, 8).scatter_add_(1, labels, weights)
        updated = torch.where(mass[..., None] > 0, sums / mass.clamp_min(1e-30)[..., None], reference)
        _reseed_empty(points, weights, updated, labels, mass)
        moved = (updated - reference).square().sum((1, 2))
        reference = updated
        if bool((moved <= settings.tol).all()):
            break
    assert iterations == count > 3 and computed[0] == 6 and min(computed) < 6  # the fast ones stopped first
    assert torch.equal(centroids, reference) and torch.equal(assign, nearest_centroid(points, reference))
