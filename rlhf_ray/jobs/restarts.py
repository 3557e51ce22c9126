"""Learner ranks that die or hang. A ZeRO group cannot go on without one of its ranks, so the attempt ends naming
the rank; the job then starts every actor again from its newest complete checkpoint, by itself, up to
`cluster.learner_restarts` times (PPO, SFT and RM jobs alike); past that it stops with the resume advice."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from pathlib import Path
from typing import Callable, TypeVar

from rlhf_ray import cluster
from rlhf_ray.actors.actor_logs import actor_logs, ray_messages
from rlhf_ray.actors.group import ActorCallTimeout, ActorDiedError, job_names, job_tag, node_lost
from rlhf_ray.jobs.checkpoints import Checkpoints
from rlhf_ray.jobs.preflight import check_on_nodes
from rlhf_ray.plan import ResourcePlan

log = logging.getLogger(__name__)
T = TypeVar("T")


class LearnerRankDied(RuntimeError):
    """A DeepSpeed rank is gone: its ZeRO group cannot go on without it. The job restarts every actor by itself
    (with_learner_restarts, cluster.learner_restarts times); once that budget is spent it stops, and this error's
    text says where a rerun resumes (`resume`)."""

    def __init__(self, rank: str, what: str, resume: str, cause: object = ""):
        super().__init__(rank, what, resume, cause)
        self.rank, self.what, self.resume, self.cause = rank, what, resume, cause
        self.restarts = 0  # automatic restarts the job had made before this death stopped it

    @property
    def event(self) -> str:
        """What happened, without what follows from it (the job restarts or stops)."""
        return f"learner rank {self.rank} {self.what}; a ZeRO group cannot continue without one of its ranks"

    def __str__(self) -> str:
        spent = (f" after {self.restarts} automatic restart{'s' * (self.restarts != 1)} (cluster.learner_restarts)"
                 if self.restarts else "")
        return f"{self.event}, so the job stops{spent}: {self.resume}." + (f"\nCause: {self.cause}" if self.cause
                                                                           else "")


@contextlib.contextmanager
def learner_deaths_explained(checkpoints: Checkpoints, groups: tuple[str, ...]):
    """A dead or hung rank of one of `groups` (actor names `<group>-<rank>`) ends the attempt with LearnerRankDied,
    naming it and where a rerun resumes. Other actors' errors pass through unchanged."""
    prefixes = tuple(f"{group}-" for group in groups)
    try:
        yield
    except (ActorDiedError, ActorCallTimeout) as err:
        ranks = [n for n in ([err.actor] if isinstance(err, ActorDiedError) else [n for n, _ in err.pending])
                 if n.startswith(prefixes)]
        if not ranks:
            raise
        what = "died" if isinstance(err, ActorDiedError) else "hangs (no answer within cluster.call_timeout_s)"
        latest = checkpoints.latest()
        resume = (f"run the job again with the same output_dir to resume from {latest}" if latest else
                  "no checkpoint was written yet (set checkpoint.every_steps), so a new run starts over")
        raise LearnerRankDied(ranks[0], what, resume, err) from err


PLACEMENTS_ON_LOST_NODES = 3
"""How many times in a row an attempt may start actors on a node that is dying. After a node is lost, Ray takes a
few seconds of missed heartbeats to mark it dead; until then it still places bundles there, and the actors started
on them die with it before they run."""


def with_learner_restarts(limit: int, checkpoints: Checkpoints, attempt: Callable[[int], T]) -> T:
    """`attempt(restarts_so_far)` until it returns; when it ends with LearnerRankDied (raised by
    learner_deaths_explained around its training, so a rank that fails to start is not retried) it runs again,
    placing its actors anew and resuming from `checkpoints`, at most `limit` more times; then the error goes up.
    An attempt whose actors died at start because their node died is placed again without counting as a restart
    (at most PLACEMENTS_ON_LOST_NODES times in a row)."""
    restarts, lost_placements = 0, 0
    while True:
        try:
            return attempt(restarts)
        except LearnerRankDied as err:
            if restarts == limit:
                err.restarts = restarts
                raise
            restarts, lost_placements = restarts + 1, 0
            log.warning("%s: the job restarts every actor from %s by itself (automatic restart %d of %d, "
                        "cluster.learner_restarts)", err.event, checkpoints.latest() or "the start", restarts, limit)
        except ActorDiedError as err:
            at_start = err.during.endswith("__init__")
            if not (at_start and node_lost(err)) or lost_placements == PLACEMENTS_ON_LOST_NODES:
                raise
            lost_placements += 1
            log.warning("%s was placed on a node that died before it started; placing every actor again",
                        err.actor)
            time.sleep(1.0)


def placed_attempts(job, checkpoints: Checkpoints, metrics, attempt: Callable[..., T],
                    adapt: Callable | None = None) -> T:
    """Connect to the job's cluster, then run `attempt(job, placements, plan, restarts)` on freshly placed
    placement groups, again after each learner restart (with_learner_restarts); the placement groups are removed
    after every attempt and the metrics logger is closed at the end. The attempt kills the actors it started (before
    the placement groups go). Unless `logging.verbose`, the actors' own output goes to <output_dir>/logs/ (one file
    per actor) and Ray's messages to the driver to <output_dir>/logs/ray.log, not to the job's terminal. The job's actors and placement groups are named after this run
    (actors.group.job_names), so jobs sharing a cluster never meet, and every attempt of this one finds its own.
    `adapt(job, nodes)`, given, returns the job fitted to the cluster's nodes before the plan is made."""
    quiet = not job.logging.verbose
    logs = Path(job.output_dir) / "logs" if quiet else None
    with cluster.connect(job.cluster, quiet=quiet) as handle, actor_logs(logs), ray_messages(logs), \
            job_names(job_tag(job.kind, job.output_dir)) as tag:
        log.info("job %s: its actors and placement groups are named %s/... on the cluster (and the dashboard)",
                 tag, tag)
        if adapt is not None:
            job = adapt(job, handle.nodes())
        plan = ResourcePlan.from_roles(job.placement_roles())

        placings = itertools.count()

        def placed(restarts: int) -> T:
            # placed again after a lost node: wait for its replacement rather than fail at once
            nodes = (handle.nodes() if next(placings) == 0 else
                     cluster.nodes_with_room(plan, handle.nodes, job.cluster.startup_timeout_s))
            placements = cluster.place(plan, nodes, job.cluster.startup_timeout_s)
            try:
                check_on_nodes(job, plan, placements, job.cluster.startup_timeout_s)  # before any actor starts
                return attempt(job, placements, plan, restarts)
            finally:
                cluster.remove(placements)

        try:
            return with_learner_restarts(job.cluster.learner_restarts, checkpoints, placed)
        finally:
            metrics.close()
