"""ResourcePlan: colocation, totals, the errors users see, and the fit check against declared node shapes."""

from __future__ import annotations

import pytest
from rich.console import Console

from rlhf_ray.config.base import FieldProblem
from rlhf_ray.config.placement import NodeShape, PlacementSpec
from rlhf_ray.plan import ResourcePlan, nodes_from_shape


def P(**kw) -> PlacementSpec:
    return PlacementSpec(**kw)


def eight_gpu_recipe() -> dict[str, PlacementSpec]:
    """Policy + reference share 4 GPUs at 0.5 each side; critic + reward share the other 4."""
    return {
        "policy": P(replicas=4, num_cpus=2, num_gpus=0.5),
        "reference": P(replicas=4, num_cpus=1, num_gpus=0.5, colocate_with="policy"),
        "critic": P(replicas=4, num_cpus=2, num_gpus=0.5),
        "reward": P(replicas=4, num_cpus=1, num_gpus=0.5, colocate_with="critic"),
    }


ONE_8GPU_NODE = nodes_from_shape([NodeShape(cpus=32, gpus=8)])


def test_single_role_group_and_totals():
    plan = ResourcePlan.from_roles({"actor": P(replicas=2, num_cpus=0.5)})
    (g,) = plan.placements
    assert (g.name, g.roles, g.strategy) == ("actor", ("actor",), "PACK")
    assert g.bundles == ({"CPU": 0.5}, {"CPU": 0.5})  # no GPU key: Ray rejects zero-valued resources
    assert plan.totals() == {"CPU": 1.0, "GPU": 0.0}
    assert plan.role_slots("actor") == ("actor", [0, 1])


def test_colocation_sums_bundles_and_shares_slots():
    plan = ResourcePlan.from_roles(eight_gpu_recipe())
    assert [g.name for g in plan.placements] == ["policy", "critic"]
    policy = plan.placement("policy")
    assert policy.roles == ("policy", "reference")
    assert policy.bundles == tuple({"CPU": 3.0, "GPU": 1.0} for _ in range(4))
    assert plan.role_slots("reference") == ("policy", [0, 1, 2, 3])
    assert plan.totals() == {"CPU": 24.0, "GPU": 8.0}
    with pytest.raises(KeyError, match="roles: policy, reference, critic, reward"):
        plan.role_slots("generator")


def test_fractional_sums_do_not_drift():
    plan = ResourcePlan.from_roles({"a": P(num_cpus=0.1, num_gpus=0.1), "b": P(num_cpus=0.2, num_gpus=0.2,
                                                                                 colocate_with="a")})
    assert plan.placements[0].bundles == ({"CPU": 0.3, "GPU": 0.3},)
    assert plan.check_fits([{"CPU": 0.3, "GPU": 0.3}]) == []


def _problem(roles) -> FieldProblem:
    with pytest.raises(FieldProblem) as e:
        ResourcePlan.from_roles(roles)
    return e.value


def test_colocate_with_unknown_role_lists_known_ones():
    e = _problem({"policy": P(), "reference": P(colocate_with="polcy"), "critic": P()})
    assert e.path == "reference.placement.colocate_with"
    assert "unknown role `polcy`" in e.message and "critic, policy" in e.message


def test_colocate_with_itself():
    e = _problem({"policy": P(colocate_with="policy")})
    assert e.path == "policy.placement.colocate_with" and "itself" in e.message


def test_colocation_chain_points_at_root():
    e = _problem({"policy": P(), "reference": P(colocate_with="policy"), "reward": P(colocate_with="reference")})
    assert e.path == "reward.placement.colocate_with"
    assert "root role `policy`" in e.message


def test_colocation_cycle():
    e = _problem({"a": P(colocate_with="b"), "b": P(colocate_with="a")})
    assert e.path == "a.placement.colocate_with"
    assert "cycle a -> b -> a" in e.message


def test_colocation_unequal_replicas_gives_numbers_and_fix():
    e = _problem({"policy": P(replicas=4), "reference": P(replicas=2, colocate_with="policy")})
    assert e.path == "reference.placement.colocate_with"
    assert "2 replicas" in e.message and "has 4" in e.message
    assert "set reference.placement.replicas to 4" in e.message


def test_eight_gpu_recipe_fits_one_eight_gpu_node():
    assert ResourcePlan.from_roles(eight_gpu_recipe()).check_fits(ONE_8GPU_NODE) == []


def test_sixteen_gpus_refused_with_arithmetic():
    roles = {"policy": P(replicas=8, num_gpus=1), "reference": P(replicas=8, num_gpus=1)}
    problems = ResourcePlan.from_roles(roles).check_fits(ONE_8GPU_NODE)
    assert len(problems) == 1
    assert "needs 16 GPUs (policy 8 x 1 + reference 8 x 1) but the cluster has 8" in problems[0]
    assert "1 node of CPU 32, GPU 8" in problems[0]


def test_cpu_shortfall_reported_alongside_gpu():
    problems = ResourcePlan.from_roles({"policy": P(replicas=4, num_cpus=16, num_gpus=4)}).check_fits(ONE_8GPU_NODE)
    assert any(p.startswith("needs 64 CPUs (policy 4 x 16)") for p in problems)
    assert any(p.startswith("needs 16 GPUs (policy 4 x 4)") for p in problems)


def test_bundle_bigger_than_any_node():
    nodes = nodes_from_shape([NodeShape(count=2, cpus=8, gpus=4)])
    problems = ResourcePlan.from_roles({"policy": P(replicas=1, num_cpus=4, num_gpus=8)}).check_fits(nodes)
    assert problems == ["placement group `policy`: a bundle of CPU 4, GPU 8 (policy CPU 4, GPU 8) fits on no node "
                        "(2 nodes of CPU 8, GPU 4); lower num_cpus / num_gpus in policy.placement, or use bigger "
                        "nodes"]


def test_strict_pack_too_big_for_any_node():
    nodes = nodes_from_shape([NodeShape(count=2, cpus=16, gpus=4)])
    plan = ResourcePlan.from_roles({"policy": P(replicas=8, num_gpus=1, strategy="STRICT_PACK")})
    problems = plan.check_fits(nodes)
    assert len(problems) == 1
    assert "`policy` is STRICT_PACK" in problems[0] and "CPU 8, GPU 8" in problems[0]
    plan = ResourcePlan.from_roles({"policy": P(replicas=8, num_gpus=1, strategy="PACK")})
    assert plan.check_fits(nodes) == []  # PACK may spread over both nodes


def test_strict_spread_needs_a_node_per_bundle():
    plan = ResourcePlan.from_roles({"gen": P(replicas=3, num_cpus=1, strategy="STRICT_SPREAD")})
    problems = plan.check_fits(nodes_from_shape([NodeShape(count=2, cpus=8)]))
    assert problems and "3 bundles need 3 nodes but the cluster has 2" in problems[0]
    assert plan.check_fits(nodes_from_shape([NodeShape(count=3, cpus=1)])) == []


def test_totals_fit_but_bundles_do_not_pack():
    # 6 GPUs needed, 6 offered, but two 2-GPU bundles cannot share a 3-GPU node.
    nodes = nodes_from_shape([NodeShape(count=2, cpus=8, gpus=3)])
    plan = ResourcePlan.from_roles({"policy": P(replicas=3, num_gpus=2)})
    problems = plan.check_fits(nodes)
    assert len(problems) == 1
    assert "placement group `policy` (3 x CPU 1, GPU 2, PACK) does not fit" in problems[0]
    assert "node 0: CPU 7, GPU 1; node 1: CPU 7, GPU 1" in problems[0]


def test_packing_names_the_group_that_does_not_fit():
    # Two STRICT_PACK groups of 3 GPUs each take a 4-GPU node; the policy's 2-GPU bundle has nowhere to go.
    nodes = nodes_from_shape([NodeShape(count=2, cpus=16, gpus=4)])
    plan = ResourcePlan.from_roles({
        "policy": P(replicas=1, num_cpus=1, num_gpus=2),
        "critic": P(replicas=3, num_cpus=1, num_gpus=1, strategy="STRICT_PACK"),
        "reward": P(replicas=3, num_cpus=1, num_gpus=1, strategy="STRICT_PACK"),
    })
    assert plan.totals()["GPU"] == 8
    (problem,) = plan.check_fits(nodes)
    assert problem.startswith("placement group `policy` (1 x CPU 1, GPU 2, PACK) does not fit")


def test_colocated_strict_spread_group_fits_mixed_nodes():
    nodes = nodes_from_shape([NodeShape(cpus=4, gpus=1), NodeShape(cpus=8, gpus=2)])
    plan = ResourcePlan.from_roles({"gen": P(replicas=2, num_cpus=2, num_gpus=1, strategy="STRICT_SPREAD"),
                                    "rm": P(replicas=2, num_cpus=1, colocate_with="gen")})
    assert plan.placement("gen").bundles == ({"CPU": 3.0, "GPU": 1.0},) * 2
    assert plan.check_fits(nodes) == []


def test_no_nodes():
    assert ResourcePlan.from_roles({"a": P()}).check_fits([]) == ["the cluster has no nodes"]


def test_render_lists_groups_roles_and_totals():
    console = Console(record=True, width=140)
    console.print(ResourcePlan.from_roles(eight_gpu_recipe()).render())
    text = console.export_text()
    for s in ("policy", "reference: CPU 1, GPU 0.5", "4 x CPU 3, GPU 1", "PACK", "CPU 24, GPU 8"):
        assert s in text, s


def test_nodes_from_shape_expands_counts():
    assert nodes_from_shape([NodeShape(count=2, cpus=8, gpus=1), NodeShape(cpus=4)]) == [
        {"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 1.0}, {"CPU": 4.0, "GPU": 0.0}]
