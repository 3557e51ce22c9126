"""ZeRO-3 inference for the forward-only roles (reference, reward model): with `sharded: true` the role's replicas
form one process group and each holds 1/N of the model's weights, gathered layer by layer as a forward runs, so a
model larger than one device can still be a reference or reward model.

The gathers are collectives: every replica must run the same forwards. The driver gives each replica its share of
the rows as usual (row_bounds); each runs as many micro-batches as the largest share needs, a replica with fewer
rows repeating one (its result dropped), and runs each micro-batch as one whole-sequence forward (sharing a prompt's
forward between rows would run a different number of forwards on different replicas). A replica that dies cannot be
replaced alone: the group goes with it, as a learner group does."""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from rlhf_ray.algorithms.experience import row_bounds, row_slices
from rlhf_ray.algorithms.micro_batches import by_token_budget, prompt_groups, row_lengths
from rlhf_ray.config.model import ModelSpec
from rlhf_ray.distributed import RendezvousHost, all_reduce, build_zero3_inference, init_process_group
from rlhf_ray.memory.probe import PeakMemory
from rlhf_ray.models import packing


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ForwardRole(RendezvousHost):
    """What the reference and reward workers share: the model (whole, or this replica's shard), how it is called,
    and the micro-batches of a replica's rows."""

    def __init__(self, *, rank: int, world_size: int, model: dict, micro_batch_size: int, sharded: bool = False,
                 max_tokens_per_micro_batch: int | None = None, pack_sequences: bool | None = None):
        self.memory = PeakMemory()  # before the model: its peak counts what the model and forwards add
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        self.rank, self.world_size, self.sharded = rank, world_size, sharded
        self.spec = ModelSpec.model_validate(model)
        self.micro, self.max_tokens, self.packed = micro_batch_size, max_tokens_per_micro_batch, pack_sequences
        self.deepspeed = None
        self.model = None if sharded else self.load_model().to(device()).eval()
        if self.model is not None:
            self.packed = packing.enable_if(self.model, self.packed)

    def load_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def setup(self, master_addr: str, master_port: int, timeout_s: float = 1800.0) -> dict:
        """Sharded replicas: join the role's process group and load this replica's shard of the weights."""
        if not self.sharded:
            raise RuntimeError("setup is for sharded replicas only")
        init_process_group(self.rank, self.world_size, master_addr, master_port, self.take_listener(master_port),
                           timeout_s)
        self.deepspeed, self._hf_ds_config = build_zero3_inference(self.load_model, self.spec, self.micro,
                                                                 self.world_size)
        self.model = self.deepspeed.module
        self.packed = packing.enable_if(self.model, self.packed)
        return {"rank": self.rank, "held_bytes": self.held_bytes()}

    def peak_memory(self) -> dict:
        """This replica's peak memory above what its process held before the model (memory/probe.py)."""
        return self.memory.peak()

    @property
    def forward(self):
        """What runs the model: the DeepSpeed engine of a sharded replica (its hooks gather the weights)."""
        return self.deepspeed if self.deepspeed is not None else self.model

    def held_bytes(self) -> int:
        """Bytes of weights this replica holds (its partitions, when sharded)."""
        return sum((p.ds_tensor if hasattr(p, "ds_tensor") else p).numel() * p.element_size()
                   for p in self.model.parameters())

    def micro_batches(self, lo: int, hi: int, rows: int, sequences: torch.Tensor, attention_mask: torch.Tensor,
                      answer_mask: torch.Tensor) -> list[np.ndarray | None]:
        """Row indices (of the batch) of rows [lo, hi) of a `rows`-row batch, micro-batch by micro-batch: every
        micro_batch_size rows in order, or with a token budget, sorted by length and cut by it (`sequences`,
        `attention_mask` and `answer_mask`: those rows' [b, P + A] tokens and mask and [b, A] answer tokens);
        sharded, padded with None (a forward whose result is dropped) to as many as the replica that needs most."""
        if self.max_tokens is None:
            mine = [np.arange(lo + s.start, lo + s.stop) for s in row_slices(hi - lo, self.micro)]
            most = max(math.ceil((b - a) / self.micro) for a, b in row_bounds(rows, self.world_size))
        else:
            groups = prompt_groups(sequences, answer_mask.shape[1])
            mine = [lo + part for part in by_token_budget(*row_lengths(attention_mask, answer_mask), self.max_tokens,
                                                          groups, packed=self.packed)]
            most = int(all_reduce([len(mine)], "MAX", device())[0]) if self.sharded else len(mine)
        return mine + [None] * (most - len(mine)) if self.sharded else mine
