"""A job's lease on a local Ray cluster: waiting for its placement group."""

import asyncio

from otray.actors.control.lease import placed


def test_a_placed_group_is_seen_placed_within_a_poll_and_a_withdrawn_wait_ends(ray_local):
    """``placed`` polls one ready reference: a group Ray has placed is seen within two polls (a fresh
    ``pg.ready()`` a poll is ready at once only about a third of the time, so ten groups would almost
    surely show a third poll); a wait for a group that cannot be placed ends as soon as it is not wanted."""
    from ray.util.placement_group import placement_group, remove_placement_group

    pgs = [placement_group([{"CPU": 0.1}]) for _ in range(10)]
    try:
        for pg in pgs:
            ray_local.get(pg.ready(), timeout=60)
        for pg in pgs:
            polls = []
            assert asyncio.run(placed(pg, lambda: polls.append(1) or True, poll_s=0.5))
            assert len(polls) <= 2, f"{len(polls)} polls for a group placed before the wait began"
        never = placement_group([{"CPU": 1000}])  # more than the cluster has: never placed
        pgs.append(never)
        polls = []
        assert not asyncio.run(placed(never, lambda: polls.append(1) or len(polls) < 3, poll_s=0.05))
        assert len(polls) == 3
    finally:
        for pg in pgs:
            remove_placement_group(pg)
