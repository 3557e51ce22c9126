"""An elastic pool's extra engines' placement groups (actors/elastic.py) on the session's Ray: the pool sees a group
as soon as Ray grants it, asks again for a group given back, and stops asking after engines keep failing to start.
The whole pool with nodes joining and leaving: tests/test_multinode.py."""

import pytest

pytestmark = pytest.mark.system

BUNDLE = {"CPU": 0.01}  # fits beside whatever else the shared Ray holds


def states(groups) -> list[str]:
    from ray.util.placement_group import placement_group_table

    return [placement_group_table(pg)["state"] for pg in groups]


def test_granted_groups_are_seen_at_the_first_look_after_ray_grants_them(shared_ray):
    """`granted` is asked once per iteration and must not wait; a group Ray has granted is in its answer at once
    (a fresh `pg.wait(0)` says False about half of the time even then, so a joining node went unused for
    iterations)."""
    import ray

    from rlhf_ray.actors.elastic import ExtraEngines

    extra = ExtraEngines(4, BUNDLE, 5)
    extra.ask()
    asked = list(extra.asked)
    try:
        assert len(asked) == 4
        ray.get([pg.ready() for pg in asked], timeout=60)
        assert extra.granted() == asked
        assert extra.granted() == [] and extra.asked == []
        for number, pg in enumerate(asked):
            extra.hold(f"generation-{number + 1}", pg, "node")
        extra.release("generation-1")  # its node left: the group goes and another is asked for
        assert "generation-1" not in extra.held and len(extra.asked) == 1
        (again,) = extra.asked
        ray.get(again.ready(), timeout=60)
        assert extra.granted() == [again]
        extra.hold("generation-5", again, "node")  # as `GenerationPool.grow` does with an engine started on it
    finally:
        extra.close()
    assert set(states([*asked, again])) == {"REMOVED"}


def test_the_pool_stops_asking_after_engines_keep_failing_to_start(shared_ray):
    """An engine that fails on every node (out of memory, say) must not be started again each iteration: after
    FAILED_STARTS failed starts the pool keeps the engines it has and asks for no more."""
    import ray

    from rlhf_ray.actors.elastic import FAILED_STARTS, ExtraEngines

    def granted_once_ready() -> list:
        ray.get([pg.ready() for pg in extra.asked], timeout=60)
        return extra.granted()

    extra = ExtraEngines(2, BUNDLE, 3, role="failing")
    extra.ask()
    seen = list(extra.asked)
    try:
        started, failing = granted_once_ready()
        extra.hold("failing-1", started, "node")
        for attempt in range(1, FAILED_STARTS + 1):
            extra.give_back(failing, failed_start=True)  # GenerationPool.grow: the engine did not start on it
            if attempt < FAILED_STARTS:
                assert len(extra.asked) == 1  # asked again in its place
                seen += extra.asked
                (failing,) = granted_once_ready()
        assert extra.wanted == 1 and extra.asked == [] and extra.ready == {} and list(extra.held) == ["failing-1"]
        extra.ask()
        assert extra.asked == []
    finally:
        extra.close()
    assert set(states(seen)) == {"REMOVED"}


def test_a_vacant_bundle_is_taken_again_once_ray_has_placed_it(shared_ray):
    """A bundle of the job's placement group whose engine left with its node waits in `vacant`; `placed_again`
    hands it out once the group is placed on live nodes, and not before (a removed group never)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from rlhf_ray.actors.elastic import ExtraEngines

    extra = ExtraEngines(0, BUNDLE, 2, role="vacant", minimum=2)
    placed, gone = placement_group([BUNDLE, BUNDLE]), placement_group([BUNDLE])
    try:
        ray.get([placed.ready(), gone.ready()], timeout=60)
        remove_placement_group(gone)
        extra.vacant = [(placed, 1), (gone, 0)]
        assert extra.placed_again() == [(placed, 1)]
        assert extra.vacant == [(gone, 0)]
        assert extra.placed_again() == []
    finally:
        remove_placement_group(placed)
