"""Jobs across real hosts: two (then three) network namespaces with addresses of their own, a Ray node in each
(`ray start`, token authentication), the host name resolving to loopback in each, and a private folder per host
(tests/hosts.py). Jobs run as a user runs them: the `rlhf-ray` command on the head's host with RAY_ADDRESS, or
`ray job submit` from another host, with the shipped quickstart configs and relative paths, no variable set by
hand. One set of hosts serves every test here (~4 min); it is skipped where namespaces cannot be made."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rlhf_ray.exit_codes import EXIT_BAD_CONFIG
from rlhf_ray.jobs.checkpoints import Checkpoints
from tests.conftest import ROOT
from tests.hosts import Hosts, unavailable

pytestmark = pytest.mark.system

BIN = Path(sys.executable).parent
PORT = 6379
ELASTIC_ITERATIONS = 15


@pytest.fixture(scope="module")
def hosts():
    """h1 (the head, where drivers run) and h2 (a worker node), 2 CPUs each."""
    if (why := unavailable()) is not None:
        pytest.skip(f"real hosts need network namespaces: {why}")
    root = Path(tempfile.mkdtemp(prefix="rh", dir="/tmp"))  # short: Ray's socket paths live under it
    # fresh machines: nothing of this process's Ray or interface settings (a test may have left GLOO_SOCKET_IFNAME)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS",
                                                             "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16), PATH=f"{BIN}:{env.get('PATH', '')}")
    made = Hosts(root, env)
    try:
        h1, h2 = made.add("h1"), made.add("h2")
        made.start_ray(h1, None, cpus=2, port=PORT)
        made.start_ray(h2, h1, cpus=2, port=PORT)
        yield made
    finally:
        made.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def workdir(hosts, tiny_model, sft_model, rm_model) -> Path:
    """What a user has in the folder they run from: the quickstart configs and the models, by relative path."""
    wd = hosts.root / "work"
    (wd / "models").mkdir(parents=True)
    for name, model in (("tiny", tiny_model), ("sft", sft_model), ("rm", rm_model)):
        shutil.copytree(model, wd / "models" / name)
    for kind in ("sft", "ppo"):
        shutil.copy(ROOT / f"configs/quickstart/{kind}.yaml", wd / f"{kind}.yaml")
    return wd


def driver_env(hosts) -> dict[str, str]:
    return {"RAY_ADDRESS": f"{hosts.hosts['h1'].address}:{PORT}"}


@contextlib.contextmanager
def ended(job):
    """Whatever happens inside, the job does not outlive the test (killed if it still runs)."""
    try:
        yield job
    finally:
        if job.poll() is None:
            job.kill()


def quickstart_ppo(output_dir: str, *settings: str) -> list[str]:
    """The quickstart PPO on the session's SFT and reward models, writing to `output_dir`, with `settings` set."""
    return ["rlhf-ray", "ppo", "--config", "ppo.yaml", *(arg for item in ("policy.model.path=models/sft",
            "reward.model.path=models/rm", f"output_dir={output_dir}", *settings) for arg in ("--set", item))]


def losses(out: Path) -> list[float]:
    return [m["train/loss"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "train/loss" in m]


def test_two_jobs_at_once_one_across_two_hosts_end_with_the_loss_curve_of_one_host(hosts, workdir, sft_model):
    """The quickstart SFT (2 ZeRO-2 ranks) with its ranks on both hosts (STRICT_SPREAD: gloo must use the nodes'
    addresses, not the host name's loopback), and beside it, at the same time on the same cluster, the same job
    packed: both finish with the loss curve of the same job on one host (the session's SFT model, trained on an
    embedded Ray). Before, the spread one failed in gloo's rendezvous and the second job on the placement group's
    name."""
    h1 = hosts.hosts["h1"]
    sft = ["rlhf-ray", "sft", "--config", "sft.yaml", "--set", "model.path=models/tiny"]
    logs = {name: hosts.root / f"{name}.log" for name in ("spread", "packed")}
    jobs = {"spread": hosts.popen(h1, [*sft, "--set", "output_dir=runs/spread", "--set", "placement.strategy="
                                       "STRICT_SPREAD"], cwd=workdir, env=driver_env(hosts), log=logs["spread"]),
            "packed": hosts.popen(h1, [*sft, "--set", "output_dir=runs/packed"], cwd=workdir, env=driver_env(hosts),
                                  log=logs["packed"])}
    codes = {name: job.wait(timeout=600) for name, job in jobs.items()}
    assert codes == {"spread": 0, "packed": 0}, {n: logs[n].read_text()[-3000:] for n in logs}
    alone = losses(sft_model.parent)
    assert losses(workdir / "runs/spread") == pytest.approx(alone, abs=1e-6)
    assert losses(workdir / "runs/packed") == pytest.approx(alone, abs=1e-6)
    tags = [line.split("job ")[1].split(":")[0] for name in logs for line in logs[name].read_text().splitlines()
            if "its actors and placement groups are named" in line]
    assert len(set(tags)) == 2 and all(t.startswith("sft-") for t in tags)  # told apart on the dashboard


def test_inputs_and_output_dir_only_on_the_drivers_host_are_refused_before_any_actor_starts(hosts, workdir):
    """Run from a folder that only the head's host has (a machine's local disk): the relative model path and
    output_dir pass every check on the driver's host, and the job is refused once placed, before any actor starts,
    naming the other host, the field, its line and the fix (shared storage)."""
    h1 = hosts.hosts["h1"]
    local = hosts.local  # private to each host
    hosts.run(h1, ["mkdir", "-p", f"{local}/outputs/quickstart"])
    hosts.run(h1, ["cp", "-r", str(workdir / "models/tiny"), f"{local}/outputs/quickstart/tiny-model"])
    hosts.run(h1, ["cp", str(workdir / "sft.yaml"), str(local)])
    done = hosts.run(h1, ["rlhf-ray", "sft", "--config", "sft.yaml", "--set", "placement.strategy=STRICT_SPREAD"],
                     cwd=local, env=driver_env(hosts), check=False, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == EXIT_BAD_CONFIG, out[-3000:]
    other = hosts.hosts["h2"].address
    assert (f"sft.yaml:6: model.path: {local}/outputs/quickstart/tiny-model is missing or unreadable on node "
            f"{other}, where the learner role was placed") in out, out[-3000:]
    assert f"sft.yaml:3: output_dir: {local}/outputs/quickstart/sft on node {other} is not the folder" in out
    assert "shared storage" in out
    actor_logs = hosts.run(h1, ["ls", "-A", f"{local}/outputs/quickstart/sft/logs"], check=False).stdout
    assert "sft-learner" not in actor_logs  # no actor started


def test_the_readmes_ray_job_submit_from_another_host_with_the_token(hosts, workdir):
    """The README's `ray job submit` (the repository as the working folder, deploy/runtime_env.yaml keeping .venv,
    .git and weights out of the upload), run on the worker's host against the head's dashboard address with the
    cluster's token (RAY_AUTH_MODE=token and the token, as docs/operations.md says): the job's driver runs on the
    head in the unpacked folder, where the relative config path resolves, and its ranks on both hosts; the model and
    output_dir name storage both hosts see. The SFT's held-out loss falls, and a wrong token is turned away."""
    h1, h2 = hosts.hosts["h1"], hosts.hosts["h2"]
    out = workdir / "runs/submitted"
    submit = ["ray", "job", "submit", "--address", f"http://{h1.address}:8265", "--working-dir", ".",
              "--runtime-env", "deploy/runtime_env.yaml", "--",
              "rlhf-ray", "sft", "--config", "configs/quickstart/sft.yaml", *(arg for item in (
                  f"model.path={workdir / 'models/tiny'}", f"output_dir={out}", "placement.strategy=STRICT_SPREAD",
                  "train.max_steps=10", "logging.progress=false") for arg in ("--set", item))]
    done = hosts.run(h2, submit, cwd=ROOT, timeout=600, check=False)
    assert done.returncode == 0 and "succeeded" in done.stdout, (done.stdout + done.stderr)[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_loss_last"] < summary["eval_loss_first"]
    assert (out / "model" / "config.json").is_file()
    refused = hosts.run(h2, submit, cwd=ROOT, env={"RAY_AUTH_TOKEN": "0" * 32}, timeout=120, check=False)
    assert refused.returncode != 0  # a wrong token is turned away


CLIENT = """
import json, sys
from rlhf_ray.actors.http_reward import HttpReward, RemoteRewardError, credentials
from rlhf_ray.config.ppo_job import HttpRewardSpec
spec = HttpRewardSpec.model_validate(json.loads(sys.argv[1]))
try:
    print(json.dumps({"scores": HttpReward(spec, **credentials(spec))(["Sort 3 2 1", "Sort 3 1"], ["1 2 3", "3 1"])}))
except RemoteRewardError as exc:
    print(json.dumps({"error": str(exc)}))
"""


def test_the_reward_server_on_another_host_wants_its_token_over_https(hosts, workdir):
    """The reference reward server on the worker's host, on its own address, with a token and a certificate; the
    driver's host scores through it with the token (read from a variable there) and the server's CA, and is refused
    with a wrong token, the error naming the URL and the status."""
    from tests.test_http_reward import self_signed

    h1, h2 = hosts.hosts["h1"], hosts.hosts["h2"]
    cert, key = self_signed(workdir, h2.address)
    (workdir / "server-token").write_text("between-hosts\n")
    server = hosts.popen(h2, [sys.executable, "-m", "rlhf_ray.reward_server", "--function",
                              "rlhf_ray.data.demo_sort:score", "--host", h2.address, "--port", "8000",
                              "--token-file", "server-token", "--tls-cert", str(cert), "--tls-key", str(key)],
                         cwd=workdir, log=hosts.root / "reward-server.log")
    url = f"https://{h2.address}:8000/score"
    try:
        spec = {"url": url, "token_env": "REWARD_TOKEN", "ca_file": str(cert), "retries": 20}  # while it starts
        scored = hosts.run(h1, [sys.executable, "-c", CLIENT, json.dumps(spec)], env={"REWARD_TOKEN": "between-hosts"})
        assert json.loads(scored.stdout) == {"scores": [1.0, 0.0]}, scored.stdout + scored.stderr
        wrong = hosts.run(h1, [sys.executable, "-c", CLIENT, json.dumps(spec)], env={"REWARD_TOKEN": "guess"})
        error = json.loads(wrong.stdout)["error"]
        assert f"POST {url}" in error and "refused the request with the token from reward.http (HTTP 401" in error
    finally:
        server.kill()
        server.wait(timeout=10)


@contextlib.contextmanager
def held(job):
    """The job's driver stopped (SIGSTOP) inside, resumed after: what happens meanwhile (a host joins, one dies)
    happens between two of its iterations, however quick they are. Ray's scheduling and failure detection go on;
    the driver meets what changed at its next call, as it would between slower iterations."""
    os.kill(job.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(job.pid, signal.SIGCONT)


def wait_for_placement(hosts, what: str, timeout: float = 60) -> None:
    """Until no placement group of the cluster waits for resources (Ray's state API, on the head's host)."""
    deadline = time.monotonic() + timeout
    while True:
        listed = hosts.run(hosts.hosts["h1"], [str(BIN / "ray"), "list", "placement-groups", "--format", "json"],
                           env=driver_env(hosts))
        states = [pg["state"] for pg in json.loads(listed.stdout)]
        if "PENDING" not in states:
            return
        assert time.monotonic() < deadline, f"not within {timeout} s: {what} ({states})"
        time.sleep(0.5)


def metric_rows(out: Path) -> list[dict]:
    """The iterations logged so far (none before the file exists)."""
    path = out / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [m for m in rows if "policy_version" in m]


def test_an_elastic_pool_takes_an_engine_on_a_host_that_joins_and_drops_it_when_the_host_dies(hosts, workdir):
    """The quickstart PPO with `generation.placement: {replicas: 1, max_replicas: 2, num_cpus: 2}`: every role but
    the engine shares one bundle (1.5 CPUs), the engine takes a whole host, and the second engine's placement group
    waits: no host has 2 CPUs free. Once the job is running a third host joins; the second engine starts there,
    loaded with the current weights. Then that host dies (every process killed, its link down): the pool drops the
    engine, the other one answers its share, and the job ends as usual: no restart spent, every update trained on
    experience of the current policy version."""
    h1 = hosts.hosts["h1"]
    out = workdir / "runs/elastic"
    log = hosts.root / "elastic.log"
    job = hosts.popen(h1, quickstart_ppo("runs/elastic", "critic.placement.colocate_with=policy",
                                         "reward.placement.colocate_with=policy", "generation.engine=hf",
                                         "generation.placement.num_cpus=2", "generation.placement.max_replicas=2",
                                         f"ppo.iterations={ELASTIC_ITERATIONS}", "ppo.eval_prompts=0",
                                         "checkpoint.every_steps=1000"),
                      cwd=workdir, env=driver_env(hosts), log=log)

    def until(what: str, seen, timeout: float = 300) -> list[dict]:
        deadline = time.monotonic() + timeout
        while not seen(rows := metric_rows(out)):
            assert job.poll() is None, f"the job ended before {what}\n" + log.read_text()[-4000:]
            assert time.monotonic() < deadline, f"not within {timeout} s: {what}\n" + log.read_text()[-4000:]
            time.sleep(0.2)
        return rows

    with ended(job):
        until("its first update", lambda rows: len(rows) >= 1)
        with held(job):  # the job's iterations take ~0.2 s: it would end before a host's Ray starts
            joining = hosts.add("e3")
            hosts.start_ray(joining, h1, cpus=2, port=PORT)
            wait_for_placement(hosts, "the second engine's placement group on the new host")
        until("an update served by two engines", lambda rows: any(m["generate/engines"] == 2 for m in rows))
        with held(job):
            hosts.lose(joining)
        assert job.wait(timeout=600) == 0, log.read_text()[-4000:]
    text = log.read_text()
    assert "generation-1 joined the generation pool (2 engines now)" in text
    assert "generation-1 left with its node; dropping it from the generation pool" in text
    steps = metric_rows(out)
    engines = [int(m["generate/engines"]) for m in steps]
    assert [m["step"] for m in steps] == list(range(1, ELASTIC_ITERATIONS + 1))
    changes = [engines[0]] + [b for a, b in zip(engines, engines[1:]) if a != b]
    assert changes == [1, 2, 1], engines  # one engine, two while the host lived, one after it died
    assert all(m["actors/restarts"] == 0 and m["actors/learner_restarts"] == 0 for m in steps)
    assert [m["policy_version"] for m in steps] == list(range(1, ELASTIC_ITERATIONS + 1))
    assert all(m["experience/staleness"] == 0 for m in steps)


def test_ppo_across_hosts_syncs_weights_between_them_and_survives_losing_a_host(hosts, workdir):
    """The quickstart PPO with policy ranks on both hosts and an engine beside each (colocated): the engine on the
    host without policy rank 0 takes the weights across hosts (the object store: ipc only within one node, said in
    the log with the reason). After the first checkpoint the worker's host dies (every process killed at once, its
    link down); a new host joins in its place, and the job restarts every role from its checkpoint by itself, within
    a minute of the loss, and ends with every step logged once."""
    h1 = hosts.hosts["h1"]
    out = workdir / "runs/ppo"
    log = hosts.root / "ppo.log"
    job = hosts.popen(h1, quickstart_ppo("runs/ppo", "policy.placement.replicas=2",
                                         "policy.placement.strategy=STRICT_SPREAD",
                                         "generation.placement.colocate_with=policy",
                                         "generation.placement.replicas=2", "generation.engine=hf",
                                         "ppo.iterations=4", "ppo.rollout_batch_size=16", "ppo.eval_prompts=8",
                                         "policy.micro_batch_size=8", "critic.micro_batch_size=16",
                                         "checkpoint.every_steps=1", "cluster.learner_restarts=1",
                                         "cluster.startup_timeout_s=300"),
                      cwd=workdir, env=driver_env(hosts), log=log)
    with ended(job):
        deadline = time.monotonic() + 600
        while not Checkpoints(out, keep_last=1).complete() and job.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint within 600 s\n" + log.read_text()[-3000:]
            time.sleep(0.2)
        assert job.poll() is None, log.read_text()[-3000:]
        with held(job):  # updates 2-4 left to meet the loss, however quick
            hosts.lose(hosts.hosts["h2"])
        lost_at = datetime.datetime.now().replace(microsecond=0)  # the log's resolution
        h3 = hosts.add("h3")
        hosts.start_ray(h3, h1, cpus=2, port=PORT)
        assert job.wait(timeout=600) == 0, log.read_text()[-4000:]
    text = log.read_text()
    assert ("weight sync: object_store (generation-1 on another node than policy-0 (ipc shares memory within one "
            "node)") in text, text[-4000:]
    assert "weight sync: ipc" not in text
    # noticed within Ray's health check, not after a connection to the lost host timed out (~2 min: results the
    # lost engines had ray.put were owned there; actors/payload.py)
    restarts = re.findall(r"^(\d\d:\d\d:\d\d) WARNING rlhf_ray.jobs.restarts: learner rank \S+ died", text, re.M)
    assert len(restarts) == 1, text[-6000:]  # one restart, for a rank (policy's or critic's) lost with the host
    (restart,) = restarts
    noticed = datetime.datetime.combine(lost_at.date(), datetime.time.fromisoformat(restart))
    assert (noticed - lost_at).total_seconds() % 86400 < 60, (restart, lost_at, text[-4000:])
    steps = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "policy_version" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]  # redone steps logged once
    assert steps[-1]["actors/learner_restarts"] == 1
