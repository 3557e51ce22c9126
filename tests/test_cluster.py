"""One embedded local Ray (2 CPUs, no dashboard) shared by every test: placement, actor groups, failures, binding."""

from __future__ import annotations

import ipaddress
import os
import sys
import time

import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from rlhf_ray.actors.group import (ActorCallTimeout, ActorDiedError, ActorGroup, RemoteCallError, Slots,  # noqa: E402
                                   Timeouts)
from rlhf_ray.cluster import ClusterTooSmall, PlacementTimeout, connect, local_nodes, place, remove  # noqa: E402
from rlhf_ray.config.placement import ClusterSpec, PlacementSpec  # noqa: E402
from rlhf_ray.plan import ResourcePlan  # noqa: E402

pytestmark = pytest.mark.system

# pytest imports this file as a top-level module the Ray workers cannot import; ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Echo:
    def __init__(self, *, rank: int, world_size: int, greeting: str = "hi"):
        self.rank, self.world_size, self.greeting = rank, world_size, greeting

    def whoami(self) -> tuple[int, int, int, str]:
        return self.rank, self.world_size, os.getpid(), ray.get_runtime_context().get_actor_name()

    def add(self, a: int, b: int) -> int:
        return a + b + self.rank

    def env(self, key: str) -> str | None:
        return os.environ.get(key)

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def fail_on(self, rank: int) -> int:
        if rank == self.rank:
            raise ValueError(f"rank {rank} says no")
        return self.rank


class Broken:
    def __init__(self, *, rank: int, world_size: int):
        raise RuntimeError("cannot load weights")

    def ping(self) -> int:
        return 1


@pytest.fixture(scope="module")
def cluster():
    t0 = time.monotonic()
    with connect(ClusterSpec(num_cpus=2, dashboard=False, namespace="rlhf_ray_test")) as handle:
        handle.startup_s = time.monotonic() - t0
        yield handle


@pytest.fixture(scope="module")
def echo(cluster):
    plan = ResourcePlan.from_roles({"echo": PlacementSpec(replicas=2, num_cpus=0.5)})
    pgs = place(plan, cluster.nodes(), timeout_s=30)
    placement, bundles = plan.role_slots("echo")
    group = ActorGroup(Echo, "echo", 2, Slots(0.5, placement_group=pgs[placement], bundle_indices=bundles,
                                              env_vars={"RLHF_RAY_TEST_VAR": "42"}),
                       kwargs={"greeting": "hello"}, timeouts=Timeouts(call_s=30, start_s=60))
    group.wait_ready()
    yield group
    group.kill()
    remove(pgs)


def small_group(cls, role: str, replicas: int = 1) -> ActorGroup:
    return ActorGroup(cls, role, replicas, Slots(0.25), timeouts=Timeouts(call_s=30, start_s=60))


def test_embedded_cluster_is_local_and_loopback(cluster):
    assert cluster.started_locally and cluster.dashboard_url is None
    assert cluster.address.startswith("127.0.0.1:")
    (node,) = cluster.nodes()
    assert node["CPU"] == 2.0
    (local,) = local_nodes(ClusterSpec(num_cpus=2, num_gpus=0))
    assert (local["CPU"], local["GPU"]) == (2.0, 0.0) and local["memory"] == psutil.virtual_memory().total


def test_group_on_placement_group_answers_by_rank(echo):
    results = echo.call("whoami")
    assert [r[0] for r in results] == [0, 1]
    assert {r[1] for r in results} == {2}
    assert len({r[2] for r in results}) == 2  # two processes
    assert [r[3] for r in results] == ["echo-0", "echo-1"] == echo.names
    assert ray.get(ray.get_actor("echo-1").whoami.remote())[0] == 1
    assert echo.call_each("add", [(1, 2), (10, 20)]) == [3, 31]
    assert ray.get(echo.submit("add", 1, b=1)) == [2, 3]
    assert echo.call("env", "RLHF_RAY_TEST_VAR") == ["42", "42"]
    assert echo.call("env", "TOKENIZERS_PARALLELISM") == ["false", "false"]  # from connect()'s runtime_env
    assert echo.call("env", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == ["0", "0"]


def test_actor_names_listed_in_namespace(echo, cluster):
    # ray.util.state.list_actors would need the dashboard; named actors are listed by the GCS itself.
    assert {"echo-0", "echo-1"} <= set(ray.util.list_named_actors())
    assert ray.get_runtime_context().namespace == cluster.namespace == "rlhf_ray_test"


def test_jobs_sharing_a_cluster_name_their_actors_and_placement_groups_apart(echo, cluster):
    """Two runs of one job (the same role, the same output folder) on one cluster, while a third group of that role
    already lives (`echo`): each run's actors and placement group carry its own tag, so neither waits on nor
    adopts the others' (before, the second `echo-0` waited out its start timeout on the first's name)."""
    from ray.util.placement_group import placement_group_table

    from rlhf_ray.actors.group import job_names, job_tag

    runs = []
    for _ in range(2):
        with job_names(job_tag("sft", "/runs/shared-out/")) as tag:
            plan = ResourcePlan.from_roles({"echo": PlacementSpec(replicas=1, num_cpus=0.25)})
            pgs = place(plan, cluster.nodes(), timeout_s=30)
            group = ActorGroup(Echo, "echo", 1, Slots(0.25, placement_group=pgs["echo"]),
                               timeouts=Timeouts(call_s=30, start_s=5))
            runs.append((tag, pgs, group))
    try:
        (a, pgs_a, group_a), (b, pgs_b, group_b) = runs
        assert a != b and a.startswith("sft-shared-out-") and b.startswith("sft-shared-out-")
        assert group_a.names == group_b.names == ["echo-0"]  # messages keep the short names
        assert [r[3] for r in group_a.call("whoami") + group_b.call("whoami")] == [f"{a}/echo-0", f"{b}/echo-0"]
        assert {f"{a}/echo-0", f"{b}/echo-0", "echo-0"} <= set(ray.util.list_named_actors())
        assert placement_group_table(pgs_a["echo"])["name"] == f"{a}/echo"
    finally:
        for _, pgs, group in runs:
            group.kill()
            remove(pgs)


def test_remote_exception_names_actor_and_keeps_traceback(echo):
    with pytest.raises(RemoteCallError) as e:
        echo.call("fail_on", 1)
    msg = str(e.value)
    assert msg.startswith("echo-1 raised in `fail_on` on node 127.0.0.1:\n")  # the host whose files it read
    assert "ValueError: rank 1 says no" in msg and ", in fail_on" in msg  # the remote traceback text
    assert "\x1b[" not in msg  # no terminal colour codes in logs
    assert isinstance(e.value.cause, ValueError) and e.value.actor == "echo-1"


def test_unknown_method_is_refused_locally(echo):
    with pytest.raises(AttributeError, match="Echo .role echo. has no method `train_step`"):
        echo.call("train_step")


def test_hung_call_times_out_naming_actor(cluster):
    group = small_group(Echo, "hang", 2).wait_ready()
    try:
        t0 = time.monotonic()
        with pytest.raises(ActorCallTimeout) as e:
            group.call_each("sleep", [(0,), (60,)], timeout=2)
        assert time.monotonic() - t0 < 5
        msg = str(e.value)
        assert msg.startswith("hang-1 did not answer `sleep` within 2 s (1 of 2 answered)")
        assert "not cancelled" in msg
        assert [name for name, _ in e.value.pending] == ["hang-1"]
    finally:
        group.kill()


def test_killed_actor_reports_death(cluster):
    group = small_group(Echo, "doomed").wait_ready()
    refs = group.submit("sleep", 30)  # die mid-call: ray.kill is asynchronous, a quick call could still win
    ray.kill(group.actors[0])
    with pytest.raises(ActorDiedError) as e:
        group.gather(refs, "sleep", timeout=20)
    assert str(e.value).startswith("doomed-0 died during `sleep`")
    assert "ray.kill" in str(e.value)  # Ray's own cause survives
    with pytest.raises(ActorDiedError, match="doomed-0 died during `whoami`"):
        group.call("whoami", timeout=20)


def test_failed_init_names_actor(cluster):
    group = small_group(Broken, "broken")
    try:
        with pytest.raises(ActorDiedError) as e:
            group.wait_ready(timeout=30)
        assert str(e.value).startswith("broken-0 died during `Broken.__init__`")
        assert "cannot load weights" in str(e.value)
    finally:
        group.kill()


def test_too_big_plan_refused_before_any_placement_group(cluster):
    from ray.util import placement_group_table

    before = len(placement_group_table())
    plan = ResourcePlan.from_roles({"policy": PlacementSpec(replicas=3, num_cpus=1)})
    with pytest.raises(ClusterTooSmall) as e:
        place(plan, cluster.nodes(), timeout_s=5)
    assert "needs 3 CPUs (policy 3 x 1) but the cluster has 2" in str(e.value)
    assert len(placement_group_table()) == before


def test_placement_timeout_names_group_and_cleans_up(cluster):
    from ray.util import placement_group_table

    def live() -> int:
        return sum(pg["state"] != "REMOVED" for pg in placement_group_table().values())

    before = live()
    plan = ResourcePlan.from_roles({"critic": PlacementSpec(replicas=2, num_cpus=2)})
    with pytest.raises(PlacementTimeout, match="placement group.s. critic not ready within 1 s"):
        place(plan, [{"CPU": 8.0}], timeout_s=1)  # nodes that lie: the check passes, Ray cannot place it
    assert live() == before


def _listening_sockets(root: psutil.Process) -> list[tuple[str, str, int]]:
    out = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            conns = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            listening = c.status == psutil.CONN_LISTEN or (not c.raddr and c.type == 2)  # TCP listen, UDP bound
            if listening:
                out.append((" ".join(proc.cmdline()[:2]) or proc.name(), c.laddr.ip, c.laddr.port))
    return out


def test_every_ray_listener_is_on_loopback(echo, cluster):
    sockets = _listening_sockets(psutil.Process())
    ports = {port for _, _, port in sockets}
    assert int(cluster.address.rsplit(":", 1)[1]) in ports  # the GCS is among what we inspected
    assert len(sockets) >= 5, sockets

    def loopback(ip: str) -> bool:
        addr = ipaddress.ip_address(ip.split("%")[0])
        return addr.is_loopback or (addr.version == 6 and addr.ipv4_mapped is not None and addr.ipv4_mapped.is_loopback)

    exposed = [s for s in sockets if not loopback(s[1])]
    assert exposed == [], f"Ray listens beyond loopback: {exposed}"


DRIVER = """
import sys, time
from rlhf_ray import cluster
from rlhf_ray.config.placement import ClusterSpec
with cluster.connect(ClusterSpec(num_cpus=1, dashboard=True)):
    print("up", flush=True)
    time.sleep(600)
"""


def test_a_killed_driver_takes_its_embedded_ray_with_it(tmp_path):
    """kill -9 of a driver that started Ray in-process: within seconds no process it started is left (Ray's agents
    used to linger for about a minute, holding the dashboard agent's port)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from tests.conftest import ROOT

    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert driver.stdout.readline().strip() == "up"
        time.sleep(3)  # the guard polls the driver's process tree once a second
        started = [p for p in psutil.Process(driver.pid).children(recursive=True)
                   if "orphan_guard" not in " ".join(p.cmdline())]
        names = {p.name() for p in started}
        assert any("raylet" in n for n in names) and any("gcs" in n for n in names), names
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                                  for p in started):
            time.sleep(0.5)
        left = [f"{p.name()} (pid {p.pid})" for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, f"still running after the driver was killed: {left}"
    finally:
        driver.kill()


AGENT_DRIVER = """
import sys, time
from ray.job_submission import JobStatus, JobSubmissionClient
from rlhf_ray import cluster
from rlhf_ray.config.placement import ClusterSpec
with cluster.connect(ClusterSpec(num_cpus=1, dashboard=True, dashboard_port=int(sys.argv[1]))) as handle:
    client = JobSubmissionClient(handle.dashboard_url)
    job = client.submit_job(entrypoint="echo agent-ok")
    deadline = time.monotonic() + 120
    while not client.get_job_status(job).is_terminal() and time.monotonic() < deadline:
        time.sleep(0.5)
    print(client.get_job_status(job), client.get_job_logs(job).strip(), flush=True)
"""


def test_an_embedded_ray_takes_jobs_while_the_default_agent_port_is_taken(tmp_path):
    """Another Ray on the machine (or a dying one) holds the dashboard agent's default port 52365: an embedded Ray
    picks a free port for its agent and still runs submitted jobs (before: "No available agent to submit job")."""
    import socket
    import subprocess
    import sys

    from rlhf_ray.cluster import free_port
    from tests.conftest import ROOT

    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", 52365))
        holder.listen()
    except OSError:  # already taken by something else: the case under test all the same
        pass
    try:
        done = subprocess.run([sys.executable, "-c", AGENT_DRIVER, str(free_port())], capture_output=True,
                              text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        holder.close()
    assert done.returncode == 0, done.stderr[-3000:]
    status, logs = done.stdout.split(" ", 1)
    assert status == "SUCCEEDED" and "agent-ok" in logs, done.stdout + done.stderr[-2000:]
