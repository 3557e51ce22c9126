"""The colocated weight handoff on CPU (models/weight_handoff.py): a learner's parameters moved into shared memory
keep training in place and another process reads them there, with no copy on the learner's side; tensors that
are elsewhere are copied into a file that goes with their bucket; files of dead learners are swept. (The whole
path, learner to engines in a PPO job, is checked in test_ppo_job.py and on a GPU in tests/gpu.)"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import torch

from rlhf_ray.models.weight_buckets import whole_layers
from rlhf_ray.models.shared_tensors import remove_orphans
from rlhf_ray.models.weight_handoff import PREFIX, HandoffSender, ParameterFile, received


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(11, 6)
        self.layer = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor, one name
        self.register_buffer("scale", torch.tensor([2.0]))

    def forward(self, ids):
        return self.head(self.layer(self.embed(ids)) * self.scale)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model(torch.tensor([[1, 2, 3]])).logsumexp(-1).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_parameters_train_in_shared_memory_and_another_process_reads_them_in_place(tmp_path):
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_step(model, optimizer)  # optimizer state exists before the move, as in a learner after its first update
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = ParameterFile(model)
    try:
        assert model.head.weight is model.embed.weight
        assert all(torch.equal(before[n], p) and params.locate(p) is not None for n, p in model.named_parameters())
        train_step(model, optimizer)  # the optimizer updates the views: the file changes
        sender = HandoffSender(params)
        groups = [list(model.named_parameters()), [("scale", model.scale.clone())]]
        parts = sender.parts(groups)
        first = next(parts)
        assert first.copied == 0 and [f.path for f in first.files] == [params.path]
        assert first.nbytes == sum(p.numel() * 4 for p in model.parameters())
        script = ("import pickle, sys, torch\n"
                  "from rlhf_ray.models.weight_handoff import received\n"
                  "part = pickle.loads(sys.stdin.buffer.read())\n"
                  "sys.stdout.buffer.write(pickle.dumps({n: t.clone() for n, t in received(part)}))\n")
        out = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(first), capture_output=True,
                             check=True, cwd=os.getcwd()).stdout
        read = pickle.loads(out)
        live = dict(model.named_parameters())
        assert set(read) == set(live) and all(torch.equal(read[n], live[n].detach()) for n in read)
        assert not all(torch.equal(read[n], before[n]) for n in read)  # the step's values, not the old ones
        second = next(parts)  # a buffer is not in the file: copied into a file of its own
        assert second.copied > 0 and second.files[0].path != params.path
        assert [(n, t.tolist()) for n, t in received(second)] == [("scale", [2.0])]
        assert next(parts, None) is None
        assert not os.path.exists(second.files[0].path)  # gone with its bucket
    finally:
        params.close()
    assert not os.path.exists(params.path)
    train_step(model, optimizer)  # the mapping outlives the file name: the learner trains on


def test_files_and_folders_of_dead_writers_are_swept_and_those_of_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    stale, live, other = (tmp_path / f"{PREFIX}{dead}-params-x", tmp_path / f"{PREFIX}{os.getpid()}-params-y",
                          tmp_path / f"{PREFIX}-unrelated")
    for path in (stale, live, other):
        path.write_bytes(b"x")
    stale_folder = tmp_path / f"rlhf-ray-adapter-{dead}-z"  # an engine's LoRA adapter folder
    stale_folder.mkdir()
    (stale_folder / "adapter_model.safetensors").write_bytes(b"x")
    remove_orphans(str(tmp_path), PREFIX)
    assert not stale.exists() and live.exists() and other.exists() and stale_folder.exists()
    remove_orphans(str(tmp_path), "rlhf-ray-adapter-")
    assert not stale_folder.exists() and live.exists()


def test_buckets_never_split_a_decoder_layer():
    units = [["model.embed_tokens.weight"], ["model.layers.0.q.weight"], ["model.layers.0.k.weight"],
             ["model.layers.1.q.base_layer.weight", "model.layers.1.q.lora_A.weight"], ["model.layers.1.k.weight"],
             ["model.norm.weight"], ["lm_head.weight"]]
    assert whole_layers(units) == [["model.embed_tokens.weight"], ["model.layers.0.q.weight", "model.layers.0.k.weight"],
                                   ["model.layers.1.q.base_layer.weight", "model.layers.1.q.lora_A.weight",
                                    "model.layers.1.k.weight"], ["model.norm.weight"], ["lm_head.weight"]]


def test_an_engine_replaced_during_a_handoff_gets_every_bucket_after_the_others():
    """WeightSync's ipc path with stand-ins for the actor groups (the real path runs in test_ppo_job.py): the
    replacement takes the whole model once the handoff in progress is over; one replaced between syncs gets it
    at once. After a part marked last the driver asks for no more: the call that frees it is submitted, not waited
    for, and collected before the next handoff starts."""
    from rlhf_ray.actors.generator import Loaded
    from rlhf_ray.jobs.ppo.weight_sync import WeightSync
    from rlhf_ray.models.weight_handoff import HandoffPart

    class Policy:
        def __init__(self):
            self.parts, self.log = None, []

        def call(self, method, bucket_bytes, adapters_only):
            assert method == "handoff_weights"
            if self.parts is None:
                assert self.log[-1:] in ([], ["collected"]), "a handoff started before the last one was closed"
                self.parts = iter([HandoffPart(nbytes=3), HandoffPart(nbytes=5, last=True), None])
            self.log.append("asked")
            return [next(self.parts)]

        def submit(self, method, bucket_bytes, adapters_only):
            assert method == "handoff_weights" and next(self.parts) is None
            self.parts = None
            self.log.append("closing")
            return ["ref"]

        def gather(self, refs, method):
            assert refs == ["ref"] and method == "handoff_weights"
            self.log.append("collected")
            return [None]

    class Pool:
        def __init__(self):
            self.taken, self.on_replaced, self.calls = [], None, 0

        def take(self, part, version, ranks=None):
            self.taken.append((part.nbytes, version, ranks))
            self.calls += 1
            if self.calls == 1:
                self.on_replaced(1)  # what resilient_gather does when engine 1 dies during `take_weights`
            return [Loaded(0, 0, 0.0)]

    class Workers:
        policy, pool = Policy(), Pool()

    weights = object.__new__(WeightSync)
    weights.workers, weights.version, weights.transport, weights.behind = Workers(), 0, "ipc", None
    weights.bucket_bytes, weights.adapters_only, weights.closing = 2**20, False, None
    Workers.pool.on_replaced = weights._hand_off_again
    result = weights.sync()
    assert Workers.pool.taken == [(3, 1, None), (5, 1, None), (3, 1, [1]), (5, 1, [1])]
    assert result.version == 1 and result.bytes == 8
    assert Workers.policy.log == ["asked", "asked", "closing", "collected", "asked", "asked", "closing"]
    Workers.pool.taken.clear()
    weights._hand_off_again(0)  # replaced while generating: brought to version 1 at once
    assert Workers.pool.taken == [(3, 1, [0]), (5, 1, [0])]
    assert Workers.policy.log[-4:] == ["collected", "asked", "asked", "closing"]


REAL_LEARNER = """
import os, torch
os.environ["DS_ACCELERATOR"] = "cpu"
from rlhf_ray.config.deepspeed import DeepSpeedSpec
from rlhf_ray.config.model import ModelSpec
from rlhf_ray.config.optim import OptimizerSpec
from rlhf_ray.distributed import init_process_group, listen
from rlhf_ray.learners.deepspeed_setup import build_deepspeed
from rlhf_ray.algorithms.losses import PolicyLoss
from rlhf_ray.learners.policy import PolicyLearner

sock = listen("127.0.0.1")
init_process_group(0, 1, "127.0.0.1", sock.getsockname()[1], sock, 120)
spec = ModelSpec(path="{model}", dtype="fp32")
learner = PolicyLearner(rank=0, world_size=1, model=spec.model_dump(), optim=OptimizerSpec().model_dump(),
                        deepspeed=DeepSpeedSpec(zero_stage=0).model_dump(), micro_batch_size=2, seed=0,
                        temperature=1.0, pad_token_id=0, loss=PolicyLoss(), train_batch_size=2)
learner.deepspeed, _ = build_deepspeed(learner.build_model(), spec, OptimizerSpec(), DeepSpeedSpec(zero_stage=0), 2, 1, 10)
for size in (1, 2**14, 2**16, 2**62):
    assert learner.engine_weight_group_count(size) == sum(1 for _ in learner.engine_weight_groups(size)), size
for in_place in (False, True):
    learner._parameters_stay_in_place = lambda: in_place
    learner.handoff = None
    for sync in range(2):
        lasts, nbytes = [], 0
        while (part := learner.handoff_weights(2**14)) is not None:
            lasts.append(part.last)
            nbytes += part.nbytes
        assert lasts[-1] and not any(lasts[:-1]) and (len(lasts) == 1) == in_place, (in_place, lasts)
        assert nbytes == sum(p.numel() * 4 for p in learner.deepspeed.module.parameters()), nbytes
    learner.release_shared_memory()
print("ok")
"""


def test_a_real_learner_marks_the_last_part_of_its_handoff(tiny_model):
    """The policy learner knows how many parts a handoff has before gathering them (so the driver need not ask once
    more to find out): only the last part says last, in place (one part) or in 16 KiB buckets, sync after sync;
    the count agrees with the groups the learner yields for every bucket size."""
    done = subprocess.run([sys.executable, "-c", REAL_LEARNER.format(model=tiny_model)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-4000:]


def test_a_lora_adapter_is_handed_over_in_one_part_whatever_the_bucket_size():
    """vLLM loads an adapter as a whole folder (one write per engine call), so an adapter sync by ipc must not be
    cut into buckets; full weights are (unless they are handed over in place)."""
    from rlhf_ray.learners.policy import PolicyLearner
    from rlhf_ray.models.weight_buckets import group_by_size

    tensors = {f"base_model.model.layers.{i}.q_proj.lora_A.weight": torch.ones(64, 4) for i in range(4)}

    def groups(bucket_bytes, adapters_only):
        for names in group_by_size(((n, t.numel() * 4) for n, t in tensors.items()), bucket_bytes):
            yield [(n, tensors[n]) for n in names]

    learner = object.__new__(PolicyLearner)
    learner.rank, learner.handoff, learner._handoff_parts = 0, HandoffSender(), None
    learner._parameters_stay_in_place = lambda: False
    learner.engine_weight_groups = groups
    learner.engine_weight_group_count = lambda bucket_bytes, adapters_only: sum(1 for _ in groups(bucket_bytes,
                                                                                                  adapters_only))

    def parts(adapters_only: bool) -> int:
        count = 0
        while learner.handoff_weights(1024, adapters_only) is not None:
            count += 1
        return count

    assert parts(adapters_only=True) == 1
    assert parts(adapters_only=False) == 4
