"""A reward served over HTTP (reward.http) against the reference server, on 127.0.0.1: the scores are the
function's, batches are split and sent concurrently, failures are retried and then name the URL and the batch,
and a PPO job trains with it."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlhf_ray.actors.http_reward import HttpReward, RemoteRewardError
from rlhf_ray.actors.reward_function import RewardFunctionWorker
from rlhf_ray.config.ppo_job import HttpRewardSpec
from rlhf_ray.reward_server import make_server, serve_in_thread


def length_score(prompts, answers, bonus=None):
    """A reward function with a dataset column: len(answer) + bonus."""
    return [len(a) + (b or 0) for a, b in zip(answers, bonus or [0] * len(answers))]


@pytest.fixture
def server():
    srv = make_server(length_score)
    url = serve_in_thread(srv)
    yield url
    srv.shutdown()
    srv.server_close()


def test_scores_come_from_the_served_function_in_batches(server):
    reward = HttpReward(HttpRewardSpec(url=server, batch_size=3, concurrency=2))
    answers = [f"answer {'x' * i}" for i in range(8)]
    scores = reward(["p"] * 8, answers, bonus=list(range(8)))
    assert scores == [len(a) + i for i, a in enumerate(answers)]  # in order, each with its own column value
    assert reward.requests == 3  # 8 answers in batches of 3


class Flaky(BaseHTTPRequestHandler):
    """Fails (HTTP 503) the first `failures` requests, or sleeps `delay` s, then answers 1.0 per answer."""

    failures, delay, seen = 0, 0.0, 0

    def do_POST(self):  # noqa: N802
        answers = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["answers"]
        type(self).seen += 1
        time.sleep(self.delay)
        if type(self).seen <= self.failures:
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b"busy")
            return
        body = json.dumps({"scores": [1.0] * len(answers)}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def flaky_server(failures: int = 0, delay: float = 0.0) -> tuple[ThreadingHTTPServer, str]:
    handler = type("Handler", (Flaky,), {"failures": failures, "delay": delay, "seen": 0})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/score"


def test_a_failing_server_is_retried_then_named_with_the_batch():
    srv, url = flaky_server(failures=2)
    try:
        reward = HttpReward(HttpRewardSpec(url=url, retries=2))
        assert reward(["p", "q"], ["a", "b"]) == [1.0, 1.0] and reward.requests == 3  # 2 failures, then served
        srv.RequestHandlerClass.seen, srv.RequestHandlerClass.failures = 0, 99
        with pytest.raises(RemoteRewardError, match=rf"POST {url} for answers 0-1 of 2 failed after 2 tries: HTTP 503"):
            HttpReward(HttpRewardSpec(url=url, retries=1))(["p", "q"], ["a", "b"])
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_slow_or_absent_server_fails_after_its_timeout_never_with_a_zero():
    srv, url = flaky_server(delay=2.0)
    try:
        with pytest.raises(RemoteRewardError, match=r"answers 0-0 of 1 failed after 1 tries: no reply within 0.3 s"):
            HttpReward(HttpRewardSpec(url=url, timeout_s=0.3, retries=0))(["p"], ["a"])
    finally:
        srv.shutdown()
        srv.server_close()
    with pytest.raises(RemoteRewardError, match=r"failed after 2 tries: .*(refused|connect)"):
        HttpReward(HttpRewardSpec(url=url, timeout_s=1, retries=1))(["p"], ["a"])


def test_a_reply_without_one_score_per_answer_fails_at_once():
    def two_scores(prompts, answers):
        return [1.0, 2.0]

    srv = make_server(two_scores)
    url = serve_in_thread(srv)
    try:
        reward = HttpReward(HttpRewardSpec(url=url, retries=3))
        with pytest.raises(RemoteRewardError, match="the reply has 2 scores for 3 answers"):
            reward(["p"] * 3, ["a", "b", "c"])
        assert reward.requests == 1  # a wrong reply is not retried
    finally:
        srv.shutdown()
        srv.server_close()


def test_the_reward_role_scores_through_the_server_and_reports_it_by_url(server, tiny_model):
    worker = RewardFunctionWorker(rank=0, world_size=1, function=None, tokenizer=str(tiny_model),
                                  http={"url": server, "batch_size": 2})
    assert worker.score_texts(["p", "q"], ["abc", "de"], [{"bonus": 1}, {"bonus": 2}]).tolist() == [4.0, 4.0]
    broken = RewardFunctionWorker(rank=0, world_size=1, function=None, tokenizer=str(tiny_model),
                                  http={"url": "http://127.0.0.1:9/score", "retries": 0, "timeout_s": 1})
    with pytest.raises(RemoteRewardError, match="reward.http: POST http://127.0.0.1:9/score for answers 0-1 of 2"):
        broken.score_texts(["p", "q"], ["abc", "de"])


def test_config_takes_a_server_or_a_function_not_both(tmp_path, tiny_model):
    """Checked when the config loads (no model is trained for it: any model folder will do)."""
    from rlhf_ray.config.loader import ConfigError
    from tests.test_ppo_job import ppo_job

    base = ["ppo.advantage_estimator=grpo", "generation.sampling.n_samples_per_prompt=2", "critic=null",
            "reward.model.path=null", "reward.placement.colocate_with=policy"]
    job = ppo_job(tmp_path, tiny_model, tiny_model, *base, "reward.http.url=http://127.0.0.1:8000/score")
    assert job.reward.http.url == "http://127.0.0.1:8000/score" and not job.reward.is_model
    with pytest.raises(ConfigError, match="reward.http: the reward is either a function or a server"):
        ppo_job(tmp_path, tiny_model, tiny_model, *base, "reward.http.url=http://127.0.0.1:8000/score",
                "reward.function=rlhf_ray.data.demo_sort:score")
    with pytest.raises(ConfigError, match="reward.http.url"):
        ppo_job(tmp_path, tiny_model, tiny_model, *base, "reward.http.url=127.0.0.1:8000")


@pytest.mark.system
def test_grpo_trains_with_a_reward_server(tmp_path, sft_model, rm_model):
    """demo/sort's rule served by the reference server; the reward actors call it for every rollout and the
    held-out evaluation (the greedy reward is then the task accuracy, as with the function in process). No KL
    term, so no reference: it plays no part in how the reward reaches the job."""
    from rlhf_ray.data.demo_sort import score
    from rlhf_ray.jobs.ppo import run_ppo
    from tests.test_ppo_job import NO_REFERENCE, ppo_job

    srv = make_server(score)
    url = serve_in_thread(srv)
    try:
        job = ppo_job(tmp_path, sft_model, rm_model, "ppo.advantage_estimator=grpo",
                      "generation.sampling.n_samples_per_prompt=4", "ppo.rollout_batch_size=8", "ppo.iterations=2",
                      "critic=null", "reward.model.path=null", f"reward.http.url={url}", "reward.http.batch_size=8",
                      "reward.placement.colocate_with=policy", "ppo.eval_prompts=8", *NO_REFERENCE)
        summary = run_ppo(job)
    finally:
        srv.shutdown()
        srv.server_close()
    assert summary["iterations"] == 2
    assert summary["reward_before"] == summary["task_accuracy_before"]
    assert summary["sampled_reward_after"] == summary["sampled_task_accuracy_after"]


def test_a_server_that_is_down_is_named_before_the_job_starts(tmp_path, tiny_model, server):
    from rlhf_ray.jobs.ppo import run_ppo
    from tests.test_ppo_job import ppo_job

    HttpReward(HttpRewardSpec(url=server)).check()  # the reference server answers the empty batch
    job = ppo_job(tmp_path, tiny_model, tiny_model, "ppo.advantage_estimator=grpo",
                  "generation.sampling.n_samples_per_prompt=2", "critic=null", "reward.model.path=null",
                  "reward.placement.colocate_with=policy", "reward.http.url=http://127.0.0.1:9/score",
                  "reward.http.retries=0", "cluster.address=127.0.0.1:9")  # Ray is never reached
    with pytest.raises(RemoteRewardError, match=r"reward.http.url: the check before the job .*127.0.0.1:9/score"):
        run_ppo(job)


def self_signed(folder, address: str = "127.0.0.1"):
    """A certificate for `address` (its own CA) and its key, as PEM files in `folder`: (cert, key)."""
    import datetime
    import ipaddress

    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, address)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(address))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "server.pem", folder / "server.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


def test_a_server_that_wants_a_token_over_https_scores_with_it_and_refuses_without_it(tmp_path, monkeypatch):
    """Between machines: the reference server requires a bearer token and serves https; the job reads the token
    from an environment variable (or a file) where it starts and checks the server's certificate with ca_file. A
    missing or wrong token is refused at once (no retries), naming the URL and the status."""
    from rlhf_ray.actors.http_reward import credentials

    cert, key = self_signed(tmp_path)
    srv = make_server(length_score, token="s3cret", tls=(str(cert), str(key)))
    url = serve_in_thread(srv)
    try:
        assert url.startswith("https://127.0.0.1:")
        monkeypatch.setenv("REWARD_TOKEN", "s3cret")
        spec = HttpRewardSpec(url=url, token_env="REWARD_TOKEN", ca_file=str(cert), retries=3)
        assert HttpReward(spec, **credentials(spec))(["p"], ["four"]) == [4.0]
        (tmp_path / "token").write_text("s3cret\n")
        spec = HttpRewardSpec(url=url, token_file=str(tmp_path / "token"), ca_file=str(cert))
        assert HttpReward(spec, **credentials(spec))(["p"], ["four"]) == [4.0]
        for token, sent in ((None, "without a token"), ("guess", "with the token from reward.http")):
            reward = HttpReward(HttpRewardSpec(url=url, ca_file=str(cert), retries=3), token=token, ca=cert.read_text())
            with pytest.raises(RemoteRewardError, match=rf"POST {url} .*refused the request {sent} \(HTTP 401"):
                reward(["p"], ["four"])
            assert reward.requests == 1  # not retried
        with pytest.raises(RemoteRewardError, match="CERTIFICATE_VERIFY_FAILED"):  # not the CA it trusts
            HttpReward(HttpRewardSpec(url=url, retries=0), token="s3cret")(["p"], ["four"])
        monkeypatch.delenv("REWARD_TOKEN")
        with pytest.raises(RemoteRewardError, match="token_env: the environment variable REWARD_TOKEN is not set"):
            credentials(HttpRewardSpec(url=url, token_env="REWARD_TOKEN"))
        with pytest.raises(ValueError, match="token_env or token_file, not both"):
            HttpRewardSpec(url=url, token_env="A", token_file="f")
    finally:
        srv.shutdown()
        srv.server_close()
