"""Geometry stage: distances, work statistics with known answers, token clouds from both model families."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment
from scipy.spatial.distance import cdist
from scipy.stats import ortho_group
from torch import nn

from benchmarks.geometry_bench import hungarian_w2
from study.errors import StudyError
from study.config.geometry import AllocationConfig
from study.geometry.clouds import TokenClouds, collect_clouds, perturbation_sensitivity, sample_positions
from study.geometry.geometries import GEOMETRIES, angle_to_poincare, pairwise_distances, pointwise_distances
from study.geometry.plots import plot_profile, plot_widths
from study.geometry import profile as profile_module
from study.geometry.profile import profile_clouds
from study.geometry.matching import diagram_w2
from study.geometry.work import gromov_wasserstein, h1_diagram, twonn_dimension

INLINE = AllocationConfig(diagram_workers=1)


def cloud(n: int = 40, d: int = 10, seed: int = 0) -> np.ndarray:
    """Low-rank structure plus noise, offset from the origin like a residual stream."""
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 3)) @ rng.normal(size=(3, d)) + 0.3 * rng.normal(size=(n, d)) + 2.0


def profile_of(before: np.ndarray, after: np.ndarray, cfg: AllocationConfig = INLINE) -> dict:
    clouds = TokenClouds(before=before[None], after=after[None], positions=np.zeros((len(before), 3), np.int64))
    return profile_clouds(clouds, cfg)


def work(profile: dict, statistic: str, geometry: str) -> float:
    return profile["stats"][statistic][geometry][0]


def test_spherical_distance_is_the_angle_and_hyperbolic_the_poincare_distance():
    x, r = cloud(), 0.9
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    angle = np.arccos(np.clip(u @ u.T, -1, 1))
    np.fill_diagonal(angle, 0)
    np.testing.assert_allclose(pairwise_distances(x, "spherical"), angle, atol=1e-7)
    p = r * u
    sq = cdist(p, p, "sqeuclidean")
    poincare = np.arccosh(1 + 2 * sq / ((1 - r**2) ** 2))
    np.testing.assert_allclose(pairwise_distances(x, "hyperbolic", r), poincare, atol=1e-7)
    np.testing.assert_allclose(pairwise_distances(x, "raw"), cdist(x, x), atol=1e-9)
    np.testing.assert_allclose(angle_to_poincare(angle, r), poincare, atol=1e-7)


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_pointwise_distances_are_the_matching_entries_of_the_pairwise_matrix(geometry):
    x, y = cloud(seed=1), cloud(seed=2)
    joint = pairwise_distances(np.vstack([x, y]), geometry, 0.8)
    n = len(x)
    pointwise = pointwise_distances(x, y, geometry, 0.8)
    np.testing.assert_allclose(pointwise, joint[np.arange(n), n + np.arange(n)], atol=1e-9)


def test_identical_clouds_do_no_work_in_any_statistic_or_geometry():
    x = cloud()
    profile = profile_of(x, x.copy())
    for statistic, by_geometry in profile["stats"].items():
        for geometry, values in by_geometry.items():
            assert values == [0.0], (statistic, geometry)


def test_a_rotation_keeps_the_metric_and_topology_but_moves_every_token():
    x = cloud()
    after = x @ ortho_group.rvs(x.shape[1], random_state=3)
    profile = profile_of(x, after)
    for geometry in GEOMETRIES:
        scale = pairwise_distances(x, geometry).mean()
        assert work(profile, "gw", geometry) < 1e-6 * scale
        assert work(profile, "topo", geometry) < 1e-5 * scale
    assert work(profile, "shift", "raw") == pytest.approx(np.linalg.norm(x - after, axis=1).mean())
    assert work(profile, "shift", "raw") > 1.0


def test_a_uniform_scaling_is_raw_work_and_no_normalised_work():
    x, s = cloud(), 1.7
    profile = profile_of(x, s * x)
    d = pairwise_distances(x, "raw")
    assert work(profile, "shift", "raw") == pytest.approx((s - 1) * np.linalg.norm(x, axis=1).mean())
    # The identity coupling's distortion bounds GW from above; a scaling leaves no better matching to find.
    assert work(profile, "gw", "raw") == pytest.approx(0.5 * (s - 1) * np.sqrt((d**2).mean()), rel=1e-6)
    assert work(profile, "topo", "raw") > 0.01
    for statistic in ("shift", "gw", "topo"):
        for geometry in ("spherical", "hyperbolic"):
            assert work(profile, statistic, geometry) < 1e-6, (statistic, geometry)


def test_a_noisy_circle_has_exactly_one_long_h1_bar():
    rng = np.random.default_rng(4)
    t = rng.uniform(0, 2 * np.pi, 80)
    points = np.zeros((80, 6))
    points[:, 0], points[:, 1] = np.cos(t), np.sin(t)
    points += 0.02 * rng.normal(size=points.shape)
    dgm = h1_diagram(pairwise_distances(points, "raw"))
    persistence = np.sort(dgm[:, 1] - dgm[:, 0])
    assert persistence[-1] > 1.0
    assert persistence[:-1].max(initial=0.0) < 0.1


@pytest.mark.parametrize("geometry", ["raw", "spherical", "hyperbolic"])
def test_ripser_and_giotto_ph_give_the_same_diagrams_bit_for_bit(geometry):
    pytest.importorskip("gph")  # the optional AGPL backend (`pip install study[gph]`; the dev extra has it)
    from study.geometry.work import vr_backend

    d = pairwise_distances(cloud(120, seed=11), geometry, 0.9)
    ours, theirs = h1_diagram(d, backend="ripser"), h1_diagram(d, threads=2, backend="gph")
    assert len(ours) > 10 and np.array_equal(ours, theirs)
    assert vr_backend("auto") == "gph" and vr_backend("ripser") == "ripser"


def full_filtration_h1(d: np.ndarray) -> np.ndarray:
    """Ripser on the whole filtration, no cut: the reference the certified cut must reproduce."""
    from ripser import ripser

    dgm = ripser(d, distance_matrix=True, maxdim=1)["dgms"][1].astype(np.float64)
    return dgm[np.lexsort((dgm[:, 1], dgm[:, 0]))]


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_the_cut_filtration_gives_the_full_filtrations_diagram_bit_for_bit(geometry):
    from study.geometry.work import h1_birth_bound

    d = pairwise_distances(cloud(150, 12, seed=12), geometry, 0.9)
    assert h1_birth_bound(d.astype(np.float32)) < 0.8 * d.max()  # the cut leaves edges out
    ours = h1_diagram(d, backend="ripser")
    assert len(ours) > 10 and np.array_equal(ours, full_filtration_h1(d))


def test_a_bar_dying_beyond_the_first_cut_is_found_by_raising_it():
    rng = np.random.default_rng(4)
    t = rng.uniform(0, 2 * np.pi, 80)
    circle = np.stack([np.cos(t), np.sin(t)], axis=1) + 0.02 * rng.normal(size=(80, 2))
    d = pairwise_distances(circle, "raw")
    reference = full_filtration_h1(d)
    lengths = np.sort(d[np.triu_indices(80, 1)].astype(np.float32))
    # the circle's bar dies (at about sqrt(3)) far beyond the first cut, a quarter above the birth bound's edges
    from study.geometry.work import h1_birth_bound

    first_cut = lengths[int(np.searchsorted(lengths, h1_birth_bound(d.astype(np.float32)), side="right") * 1.25)]
    assert reference[:, 1].max() > first_cut
    assert np.array_equal(h1_diagram(d, backend="ripser"), reference)


def test_the_birth_bound_is_the_longest_edge_without_a_witness():
    from study.geometry.work import h1_birth_bound

    d = pairwise_distances(cloud(60, 6, seed=13), "spherical").astype(np.float32)
    # brute force: edge uv has a witness w when both d(u, w) and d(v, w) are below d(u, v)
    closest = np.maximum(d[:, None, :], d[None, :, :]).min(axis=2)
    u, v = np.triu_indices(60, 1)
    unwitnessed = d[u, v][closest[u, v] >= d[u, v]]
    assert h1_birth_bound(d) == unwitnessed.max()
    assert full_filtration_h1(d)[:, 0].max() <= unwitnessed.max()


def test_gw_from_the_identity_is_the_solvers_value_from_the_identity():
    import ot

    for shuffled in (False, True):  # a stationary identity (closed form) and one the solver moves away from
        x = cloud(40, seed=3)
        y = (np.roll(x, 5, axis=0) if shuffled else x + 0.3 * np.tanh(x)) + 0.05 * cloud(40, seed=4)
        dx, dy = pairwise_distances(x, "raw"), pairwise_distances(y, "raw")
        scale = max(dx.mean(), dy.mean())
        w = np.full(40, 1 / 40)
        _, log = ot.gromov.gromov_wasserstein(dx / scale, dy / scale, w, w, "square_loss", G0=np.eye(40) / 40,
                                              log=True)
        closed_form = float(((dx / scale - dy / scale) ** 2).mean())
        want = 0.5 * scale * np.sqrt(min(log["gw_dist"], closed_form))
        assert gromov_wasserstein(dx, dy) == pytest.approx(want, rel=1e-9), shuffled
        assert (want < 0.5 * scale * np.sqrt(closed_form) * (1 - 1e-3)) == shuffled


def test_a_plain_install_pulls_no_agpl_package():
    """Walk the installed requirement tree of `study` without extras: no distribution in it is AGPL-licensed."""
    import re
    from importlib import metadata

    def licence(dist) -> str:
        """The declared licence: expression, classifiers, and a short License field (some wheels put every bundled
        third-party licence text there, which would match on a mention)."""
        meta = dist.metadata
        short = meta.get("License", "") or ""
        return " ".join([short if len(short) < 200 else "", meta.get("License-Expression", "") or "",
                         *[c for c in meta.get_all("Classifier", []) if c.startswith("License")]])

    seen, todo, agpl = set(), ["study"], []
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an environment marker left it out of this platform
        if re.search(r"AGPL|Affero", licence(dist)):
            agpl.append(name)
        for req in dist.requires or []:
            if "extra ==" in req:
                continue  # only what a plain `pip install` pulls
            todo.append(re.match(r"[A-Za-z0-9_.-]+", req).group(0))
    assert "torch" in seen and "ripser" in seen and "giotto-ph" not in seen
    assert agpl == []
    assert re.search(r"AGPL|Affero", licence(metadata.distribution("giotto-ph")))  # the check does see AGPL


def test_the_hyperbolic_diagram_is_the_spherical_diagram_with_distances_mapped():
    x, r = cloud(60, seed=5), 0.9
    mapped = angle_to_poincare(h1_diagram(pairwise_distances(x, "spherical")), r)
    direct = h1_diagram(pairwise_distances(x, "hyperbolic", r))
    assert len(direct) > 3
    order = lambda dgm: dgm[np.lexsort((dgm[:, 1], dgm[:, 0]))]  # noqa: E731
    np.testing.assert_allclose(order(mapped), order(direct), rtol=1e-5)


def test_diagram_w2_is_the_optimal_partial_matching_with_the_diagonal():
    rng = np.random.default_rng(6)
    a = np.sort(rng.uniform(0, 1, (30, 2)), axis=1)
    b = np.sort(rng.uniform(0, 1, (25, 2)), axis=1)
    # Exact W2 with the L2 ground metric: points may also go to the diagonal at cost (persistence^2) / 2.
    n, m = len(a), len(b)
    cost = np.zeros((n + m, n + m))
    cost[:n, :m] = cdist(a, b, "sqeuclidean")
    cost[:n, m:] = ((a[:, 1] - a[:, 0]) ** 2 / 2)[:, None]
    cost[n:, :m] = ((b[:, 1] - b[:, 0]) ** 2 / 2)[None, :]
    rows, cols = linear_sum_assignment(cost)
    exact = np.sqrt(cost[rows, cols].sum())
    assert diagram_w2(a, b) == pytest.approx(exact, rel=1e-9)
    assert diagram_w2(a, np.empty((0, 2))) == pytest.approx(np.sqrt(cost[:n, m].sum()), rel=1e-12)
    assert diagram_w2(a, a) == 0.0


def _diagram(rng, k: int, span: float, longest: float) -> np.ndarray:
    birth = rng.uniform(0, span, k)
    return np.column_stack([birth, birth + rng.uniform(0, longest, k)])


@pytest.mark.parametrize("span, longest", [(100.0, 2.0), (1.0, 1.0)], ids=["sparse", "dense"])
def test_flow_and_simplex_reach_the_assignment_optimum_with_either_diagram_larger(span, longest):
    from study.geometry import matching

    rng = np.random.default_rng(11)
    a, b = _diagram(rng, 150, span, longest), _diagram(rng, 120, span, longest)
    for x, y in ((a, b), (b, a)):
        exact = hungarian_w2(x, y)
        assert matching.diagram_w2(x, y, "flow") == pytest.approx(exact, rel=1e-12)
        assert matching.diagram_w2(x, y, "simplex") == pytest.approx(exact, rel=1e-12)


def test_auto_solves_sparse_pairs_by_flow_and_dense_ones_by_the_simplex(monkeypatch):
    from study.geometry import matching

    rng = np.random.default_rng(12)
    sparse = _diagram(rng, 150, 100.0, 2.0), _diagram(rng, 150, 100.0, 2.0)
    dense = _diagram(rng, 150, 1.0, 1.0), _diagram(rng, 150, 1.0, 1.0)
    expected = {"sparse": matching.diagram_w2(*sparse, "flow"), "dense": matching.diagram_w2(*dense, "simplex")}

    def refuse(*args):
        raise AssertionError("the other solver was chosen")

    monkeypatch.setattr(matching, "_simplex", refuse)
    assert matching.diagram_w2(*sparse) == expected["sparse"]
    monkeypatch.undo()
    monkeypatch.setattr(matching, "_flow", refuse)
    assert matching.diagram_w2(*dense) == expected["dense"]
    with pytest.raises(ValueError, match="choose one of auto, flow, simplex"):
        matching.diagram_w2(*dense, "hera")


def test_gw_from_the_identity_never_exceeds_the_distortion_of_the_correspondence():
    x = cloud(50, seed=7)
    y = x + 0.5 * np.tanh(x @ np.random.default_rng(8).normal(size=(10, 10)))
    dx, dy = pairwise_distances(x, "raw"), pairwise_distances(y, "raw")
    gw = gromov_wasserstein(dx, dy)
    assert 0 < gw <= 0.5 * np.sqrt(((dx - dy) ** 2).mean()) * (1 + 1e-9)


def test_twonn_recovers_the_dimension_of_a_flat_manifold():
    rng = np.random.default_rng(9)
    flat = rng.uniform(size=(800, 3)) @ ortho_group.rvs(20, random_state=9)[:3]
    assert twonn_dimension(pairwise_distances(flat, "raw")) == pytest.approx(3.0, rel=0.12)


@pytest.mark.integration
def test_profile_is_json_and_worker_processes_agree_with_inline(monkeypatch):
    rng = np.random.default_rng(10)
    before = np.stack([cloud(32, 8, seed) for seed in range(3)]).astype(np.float32)
    after = before + 0.2 * rng.normal(size=before.shape).astype(np.float32)
    clouds = TokenClouds(before, after, np.zeros((32, 3), np.int64))
    inline = profile_clouds(clouds, INLINE, sensitivity=[0.1, 0.2, 0.3])
    monkeypatch.setattr(profile_module, "POOL_MIN_TOKENS", 0)  # use the workers even on this tiny cloud
    pooled = profile_clouds(clouds, AllocationConfig(diagram_workers=2))
    assert pooled["stats"] == inline["stats"]
    assert json.loads(json.dumps(inline))["stats"] == inline["stats"]
    assert inline["layers"] == 3 and inline["n_tokens"] == 32 and inline["sensitivity"] == [0.1, 0.2, 0.3]
    assert set(inline["timings"]) >= {"shift", "gw", "topo", "distances", "intrinsic_dim", "wall"}
    assert all(all(v > 0 for v in by_g.values() for v in by_g[g]) for by_g in inline["stats"].values() for g in by_g)


def test_plots_are_written(tmp_path):
    before = np.stack([cloud(24, 6, seed) for seed in range(2)])
    profile = profile_clouds(TokenClouds(before, 1.1 * before + 0.1, np.zeros((24, 3), np.int64)), INLINE)
    assert plot_profile(profile, tmp_path / "profile.png").stat().st_size > 10_000
    widths = {"uniform": [4.0, 4.0], "cosine": [6.0, 2.0], "topo/hyperbolic": [5.0, 3.0]}
    assert plot_widths(widths, tmp_path / "widths.png").stat().st_size > 10_000


# Token clouds -------------------------------------------------------------------------------------------------


def test_sampled_positions_are_distinct_seeded_and_skip_the_first_position():
    shapes = [(2, 16), (3, 8)]
    picks = sample_positions(shapes, 40, seed=1, min_position=1)
    assert len({tuple(p) for p in picks}) == 40
    assert picks[:, 2].min() >= 1
    assert all(p[1] < shapes[p[0]][0] and p[2] < shapes[p[0]][1] for p in picks)
    np.testing.assert_array_equal(picks, sample_positions(shapes, 40, seed=1, min_position=1))
    assert not np.array_equal(picks, sample_positions(shapes, 40, seed=2, min_position=1))
    with pytest.raises(StudyError, match="n_tokens"):
        sample_positions(shapes, 100, seed=1, min_position=1)


class TinyBlock(nn.Module):
    """A block in this project's layout: out = h + ffn_sublayer(h), the sublayer returning the increment."""

    def __init__(self, d: int):
        super().__init__()
        self.mix = nn.Linear(d, d)
        self.ffn_sublayer = nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))

    def forward(self, x):
        h = x + torch.tanh(self.mix(x)).cumsum(dim=1) / 4
        return h + self.ffn_sublayer(h)


class TinyModel(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16, layers: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(TinyBlock(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def test_project_blocks_give_the_sublayer_input_and_input_plus_increment():
    model = TinyModel()
    batches = [torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(1))]
    clouds = collect_clouds(model, batches, n_tokens=10, seed=0)
    assert clouds.before.shape == (3, 10, 16)
    with torch.no_grad():
        x = model.embed(batches[0])
        rows, cols = clouds.positions[:, 1], clouds.positions[:, 2]
        for layer, block in enumerate(model.layers):
            h = x + torch.tanh(block.mix(x)).cumsum(dim=1) / 4
            x = h + block.ffn_sublayer(h)
            np.testing.assert_allclose(clouds.before[layer], h[rows, cols].numpy(), rtol=1e-6)
            np.testing.assert_allclose(clouds.after[layer], x[rows, cols].numpy(), rtol=1e-6)


def tiny_hf(config_name: str = "LlamaConfig"):
    import transformers

    config = getattr(transformers, config_name)(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, head_dim=8, eos_token_id=None,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("config_name", ["LlamaConfig", "Gemma2Config", "Gemma3TextConfig", "Olmo2Config"])
def test_hugging_face_clouds_after_the_ffn_are_the_block_outputs(config_name):
    model = tiny_hf(config_name)
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 64, (2, 16), generator=gen), torch.randint(0, 64, (3, 16), generator=gen)]
    clouds = collect_clouds(model, batches, n_tokens=24, seed=3)
    with torch.no_grad():
        hidden = [model(ids, output_hidden_states=True).hidden_states for ids in batches]
    for layer in range(2):  # the last entry of hidden_states has the final norm applied
        block_output = np.stack([hidden[b][layer + 1][r, p].numpy() for b, r, p in clouds.positions])
        np.testing.assert_array_equal(clouds.after[layer], block_output)


def test_hugging_face_llama_before_is_the_input_of_the_mlp_branch():
    model = tiny_hf()
    clouds = collect_clouds(model, [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))], 12)
    block = model.model.layers[1]
    with torch.no_grad():
        branch = block.mlp(block.post_attention_layernorm(torch.from_numpy(clouds.before[1])))
    np.testing.assert_allclose(clouds.after[1] - clouds.before[1], branch.numpy(), atol=1e-5)


def test_an_unknown_architecture_is_a_user_error():
    model = nn.Linear(4, 4)
    model.config = type("Config", (), {"model_type": "bert"})()
    with pytest.raises(StudyError, match="bert"):
        collect_clouds(model, [torch.zeros(1, 8, dtype=torch.long)], n_tokens=4)


def test_a_layer_whose_ffn_outputs_nothing_has_zero_sensitivity():
    model = TinyModel()
    with torch.no_grad():
        model.layers[1].ffn_sublayer[2].weight.zero_()
        model.layers[1].ffn_sublayer[2].bias.zero_()
    batches = [torch.randint(0, 32, (4, 12), generator=torch.Generator().manual_seed(5))]
    sensitivity = perturbation_sensitivity(model, batches, eps=0.2)
    assert sensitivity[1] == 0.0
    assert abs(sensitivity[0]) > 1e-6 and abs(sensitivity[2]) > 1e-6
    hf = perturbation_sensitivity(tiny_hf(), [torch.randint(0, 64, (2, 16))], eps=0.2)
    assert len(hf) == 3 and all(np.isfinite(hf))


@pytest.mark.parametrize("block", ["llama", "olmo2"])
def test_the_intrinsic_dimension_cloud_is_what_the_ffn_receives(block):
    from study.config.model import FFNConfig, ModelConfig
    from study.models.transformer import build_model

    cfg = ModelConfig(block=block, d_model=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=16,
                      ffn=FFNConfig(widths=[40, 40]))
    model = build_model(cfg, "cpu", seed=0)
    with torch.no_grad():  # gains other than 1, so a normalised copy differs from a scaled one
        for b in model.layers:
            b.ffn_sublayer.norm.weight.uniform_(0.5, 1.5)
    batches = [torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(2)) for _ in range(3)]
    clouds = collect_clouds(model, batches, n_tokens=40, seed=0)
    assert clouds.n_sequences == len({(b, r) for b, r, _ in clouds.positions}) > 8
    for layer, b in enumerate(model.layers):
        h = torch.as_tensor(clouds.before[layer])
        want = h if block == "olmo2" else b.ffn_sublayer.norm(h)  # olmo2 normalises the FFN's output, not input
        np.testing.assert_allclose(clouds.received[layer], want.detach().numpy(), rtol=1e-5, atol=1e-6)
    profile = profile_clouds(clouds, AllocationConfig(diagram_workers=1))
    assert profile["n_sequences"] == clouds.n_sequences
    assert {s for g in profile["gw_start"].values() for s in g} <= {"identity", "product"}


def test_gw_keeps_the_lower_of_the_identity_and_the_default_start_when_both_are_asked_for():
    import ot

    from study.geometry.work import gromov_wasserstein_starts

    x = cloud(40, seed=3)
    y = np.roll(x, 5, axis=0) + 0.05 * cloud(40, seed=4)  # tokens shuffled: the identity is a poor correspondence
    dx, dy = pairwise_distances(x, "raw"), pairwise_distances(y, "raw")
    value, start = gromov_wasserstein_starts(dx, dy, "both")
    scale = max(dx.mean(), dy.mean())
    w = np.full(40, 1 / 40)
    solves = {s: ot.gromov.gromov_wasserstein(dx / scale, dy / scale, w, w, "square_loss", G0=g0, log=True)[1]["gw_dist"]
              for s, g0 in (("identity", np.eye(40) / 40), ("product", None))}
    solves["identity"] = min(solves["identity"], float(((dx / scale - dy / scale) ** 2).mean()))
    assert start == min(solves, key=solves.get)
    assert value == pytest.approx(0.5 * scale * np.sqrt(max(min(solves.values()), 0.0)), rel=1e-12)
