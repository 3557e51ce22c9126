"""Shared fixtures. Nothing here reaches a hub: models and tokenizers are built locally."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

from tests.clean_exit import pytest_sessionfinish, pytest_unconfigure  # noqa: F401 (hooks: the process ends there)

ROOT = Path(__file__).resolve().parent.parent
# pytest imports this file as `conftest` (tests/ has no __init__.py), test modules as `tests.conftest`: one module
# under both names, so that its state (the session's Ray, _SESSION_RAY) is one object whichever name reaches it.
sys.modules.setdefault("tests.conftest", sys.modules[__name__])
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Every Ray the tests start: a killed process that cannot answer Ray's request to exit (the fault tests stop their
# actors with SIGSTOP) is killed by its raylet after 1 s instead of 5, and its replacement waits that long for the
# bundle; a process that answers exits at once either way.
os.environ.setdefault("RAY_kill_worker_timeout_milliseconds", "1000")


@pytest.fixture(scope="session", autouse=True)
def shared_gguf_imports(tmp_path_factory):
    """Jobs that name a GGUF model (package:smollm2) import it once per session, not once per output_dir
    (RLHF_RAY_MODELS_DIR; the test of the default location unsets it)."""
    from rlhf_ray.models.sources import MODELS_DIR_ENV

    folder = tmp_path_factory.mktemp("imported-models")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(MODELS_DIR_ENV, str(folder))
        yield folder


@pytest.fixture(scope="session")
def smollm2(shared_gguf_imports) -> Path:
    """SmolLM2-135M-Instruct as `rlhf-ray init-model --from smollm2` writes it, imported once per session, into the
    folder where jobs naming `package:smollm2` import it (so they reuse it: an import costs ~8 s)."""
    from rlhf_ray.cli import main
    from rlhf_ray.models.packaged import packaged_gguf
    from rlhf_ray.models.sources import imported_folder

    out = imported_folder(packaged_gguf("smollm2"), shared_gguf_imports)
    if not (out / "config.json").is_file():  # a job of this session may have imported it already
        assert main(["init-model", "--from", "smollm2", "--out", str(out)]) == 0
    return out


@pytest.fixture
def write_yaml(tmp_path: Path):
    """Write a YAML text to a file in tmp_path and return its path."""

    def write(text: str, name: str = "job.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny Llama + tokenizer, built once per test session (offline)."""
    from rlhf_ray.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


def _quick_stage(kind: str, root: Path, tiny_model: Path) -> Path:
    from rlhf_ray.config import load_job
    from rlhf_ray.jobs.supervised import run_supervised

    overrides = [f"model.path={tiny_model}", f"output_dir={root / kind}", "cluster.dashboard=false",
                 "logging.progress=false"]
    _SESSION_RAY.open()  # the session's Ray, which the test asking for the model may share (or close)
    run_supervised(load_job(ROOT / f"configs/quickstart/{kind}.yaml", overrides))
    return root / kind / "model"


@pytest.fixture(scope="session")
def sft_model(tmp_path_factory, tiny_model) -> Path:
    """The tiny model after the quickstart SFT on demo/sort: answers end with end-of-text (PPO's start)."""
    return _quick_stage("sft", tmp_path_factory.mktemp("stages"), tiny_model)


@pytest.fixture(scope="session")
def rm_model(tmp_path_factory, sft_model) -> Path:
    """A reward model trained by the quickstart RM config on demo/sort pairs, from the SFT model as there."""
    return _quick_stage("rm", tmp_path_factory.mktemp("stages"), sft_model)


def left_on_the_node(*patterns: str) -> set[Path]:
    """Files and folders matching `patterns` in /dev/shm and the temporary folder: what jobs leave outside their
    output_dir (compare a set taken before a job with one taken after)."""
    import tempfile

    return {p for d in {"/dev/shm", tempfile.gettempdir()} for pattern in patterns for p in Path(d).glob(pattern)}


@contextlib.contextmanager
def placed_trainer(job, tokenizer, data, tokens=None):
    """A PPOTrainer on its roles, placed on the job's cluster (an embedded Ray unless one is connected), as run_ppo
    places it; every actor and placement group goes at the end. Tests drive its parts: a rollout scored and put
    with `trainer.rollouts.put`, then `trainer.iterate(step)`, the loop body of `fit` (one_update does both)."""
    from rlhf_ray import cluster
    from rlhf_ray.plan import ResourcePlan

    with cluster.connect(job.cluster) as handle:
        plan = ResourcePlan.from_roles(job.placement_roles())
        placements = cluster.place(plan, handle.nodes(), 120)
        try:
            with trainer_on(job, plan, placements, tokenizer, data, tokens) as trainer:
                yield trainer
        finally:
            cluster.remove(placements)


@contextlib.contextmanager
def trainer_on(job, plan, placements, tokenizer, data, tokens=None):
    """A PPOTrainer whose roles start on placement groups the caller placed; its actors are killed at the end."""
    from rlhf_ray.data.tokens import TokenConventions
    from rlhf_ray.jobs.checkpoints import Checkpoints
    from rlhf_ray.jobs.metrics import MetricsLogger
    from rlhf_ray.jobs.ppo.trainer import Attempt, PPOTrainer
    from rlhf_ray.jobs.ppo.workers import RoleWorkers

    tokens = tokens or TokenConventions.from_tokenizer(tokenizer, job.policy.model.path)
    workers = None
    metrics = MetricsLogger(job.output_dir, job.logging, run_name="test")
    try:
        workers = RoleWorkers(job, plan, placements, tokenizer, tokens)
        yield PPOTrainer(job, workers, data, tokenizer,
                         Attempt(metrics, Checkpoints(job.output_dir, job.checkpoint.keep_last)))
    finally:
        metrics.close()
        if workers is not None:  # named actors go before their placement groups: the next test can take the names
            workers.kill()


def one_update(trainer, step: int, rollout) -> dict[str, float]:
    """Train on `rollout` (collected by the test): scored and put in the buffer, then one iteration of the loop."""
    scorer, version = trainer.workers.scorer, trainer.weights.version
    trainer.rollouts.put(step, rollout, scorer.advantages(scorer.score(rollout), version), version)
    return trainer.iterate(step)[1]


def swap_engine(trainer, job, plan, placements, tokens) -> None:
    """The trainer's generation pool replaced by `job`'s engine on the same bundles and brought to the current
    weights (the same learners, reference and reward: one engine, then the other, in one run)."""
    from rlhf_ray.actors.pool import GenerationPool

    workers = trainer.workers
    workers.pool.group.kill()
    name, bundles = plan.role_slots("generation")
    workers.pool = GenerationPool.start(job, placements[name], bundles, tokens, workers.restarts)
    trainer.weights.sync(bump=False)


class _SessionRay:
    """One embedded Ray (2 CPUs, no dashboard: the shape of every quickstart and recipe job the system tests run)
    kept open across the test modules that share it, instead of one started and stopped per job or module (~5-8 s
    each): `cluster.shared`, which every `cluster.connect` inside it reuses. A test that needs Ray to itself (its
    own cluster shape, `ray start`, or no Ray at all) closes it first; the next sharing test opens it again."""

    def __init__(self):
        self._block: contextlib.ExitStack | None = None
        self.handle = None

    def open(self):
        if self._block is None:
            from rlhf_ray import cluster
            from rlhf_ray.config.placement import ClusterSpec

            block = contextlib.ExitStack()
            self.handle = block.enter_context(cluster.shared(ClusterSpec(num_cpus=2, dashboard=False)))
            self._block = block
        return self.handle

    def close(self) -> None:
        block, self._block, self.handle = self._block, None, None
        if block is not None:
            block.close()


_SESSION_RAY = _SessionRay()


@pytest.fixture(scope="module")
def shared_ray():
    """The session's embedded Ray: the jobs of a module that asks for it (and its module fixtures set up after
    this one) reuse it."""
    return _SESSION_RAY.open()


@pytest.fixture(autouse=True)
def ray_for_each_test(request, monkeypatch):
    """A test that asks for `shared_ray` finds it open (again). Every other test finds no Ray running: system tests
    start their own cluster, and the others may check that nothing started one. The fast tier (`bash
    scripts/test.sh --fast`: every test not marked `system`) runs without Ray: a test that starts one must say so
    with @pytest.mark.system, or it fails here, naming itself."""
    if "shared_ray" in request.fixturenames:
        _SESSION_RAY.open()
        return
    _SESSION_RAY.close()
    if request.node.get_closest_marker("system") is not None:
        return
    import ray

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{request.node.nodeid} starts Ray but is not marked @pytest.mark.system (the fast "
                           "tier runs without Ray)")

    monkeypatch.setattr(ray, "init", refuse)


@pytest.fixture(scope="session", autouse=True)
def session_ray_closed_at_the_end():
    yield
    _SESSION_RAY.close()


@pytest.hookimpl(trylast=True)  # after pytest's own grouping of tests by their module-scoped parameters
def pytest_collection_modifyitems(items):
    """Run the test files in three blocks (each file's tests together): those that start no Ray (the fast tier:
    failures show within minutes), those that start Ray of their own, then those sharing the session's; in a file
    of the last block its tests without Ray run first. So the shared Ray starts once."""

    def shares(item) -> bool:
        return "shared_ray" in item.fixturenames

    def block(item) -> int:
        return 0 if item.get_closest_marker("system") is None else 1 + shares(item)

    def path(item) -> str:
        return item.nodeid.split("::")[0]

    blocks: dict[str, int] = {}  # a file's block: that of its most demanding test
    first: dict[str, int] = {}  # where its first test was
    for position, item in enumerate(items):
        blocks[path(item)] = max(blocks.get(path(item), 0), block(item))
        first.setdefault(path(item), position)
    items.sort(key=lambda item: (blocks[path(item)], first[path(item)], shares(item)))


# ---- where the suite's time goes -------------------------------------------------------------------------------

_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """After pytest's slowest tests: the slowest test files (setup, call and teardown summed), to see which part of
    the suite to make cheaper."""
    if not _FILE_SECONDS:
        return
    terminalreporter.section("slowest 12 test files")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda item: -item[1])[:12]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {path}")


def job_actor(name: str, namespace: str):
    """The live actor `name` (`policy-0`) of the job running now: jobs name their actors `<job tag>/<name>`
    (actors.group.job_names), and a test runs one job at a time."""
    import ray

    found = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == namespace and a["name"].endswith(f"/{name}")]
    if not found:
        raise ValueError(f"no live actor named <job>/{name} in namespace {namespace}")
    return ray.get_actor(found[-1], namespace=namespace)


def at_checkpoints(monkeypatch, *actions) -> None:
    """actions[k] runs right after the (k+1)-th checkpoint a job commits (any attempt's), on the job's own thread:
    the job meets what it did (an actor killed, a node gone) at its next step, however quick its steps. A thread
    that watches the checkpoints instead can act after the job's last step."""
    from rlhf_ray.jobs.checkpoints import Checkpoints

    commit, done = Checkpoints.commit, []

    def commit_then_act(self, staging, step, state):
        final = commit(self, staging, step, state)
        if len(done) < len(actions):
            done.append(step)
            actions[len(done) - 1]()
        return final

    monkeypatch.setattr(Checkpoints, "commit", commit_then_act)
