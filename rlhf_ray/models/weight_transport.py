"""The collective weight transport: learner rank 0 broadcasts buckets to every engine over a process group of its
own (NCCL between GPUs, gloo on CPU), tensor to tensor, with no host round trip on GPUs. The group is separate
from DeepSpeed's (ranks: learner 0, engines 1..K) and is formed again whenever an engine is replaced.

Each bucket is sent as a header (its names, shapes and dtype, pickled into bytes) followed by its flat tensor; an
empty header ends a sync. So receivers need no layout agreed in advance."""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Iterable, Iterator

import torch

from rlhf_ray.models.weight_buckets import Named, dtype_runs, flatten, split_flat


def gpus_shared(devices: dict[str, tuple[str, list]]) -> list[str]:
    """Members of a would-be NCCL group that sit on the same GPU as another: NCCL refuses two ranks on one device,
    which is where fractional bundles put a policy and its engine on a one-GPU machine. `devices`: member name ->
    (node id, the GPU ids Ray gave it)."""
    first: dict[tuple[str, str], str] = {}
    shared = []
    for name, (node, gpus) in devices.items():
        for gpu in gpus:
            other = first.setdefault((node, str(gpu)), name)
            if other != name:
                shared.append(f"{other} and {name} share GPU {gpu} of node {node[:8]}")
    return shared


class WeightBroadcast:
    """Learner rank 0 and the engines in a process group of their own: `send` on rank 0, `receive` on the others."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float, listener=None):
        """Rank 0 (the learner) serves the process group's store on `listener`, a socket bound to `host` only."""
        import torch.distributed as dist

        from rlhf_ray.distributed import bind_to_node_address, rendezvous_store

        bind_to_node_address()
        self.rank = rank
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        timeout = datetime.timedelta(seconds=timeout_s)
        store = rendezvous_store(host, port, rank, world_size, timeout, listener)
        if self.device is not None:
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
            self.device = torch.device("cpu")

    def _broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor], opts).wait()

    def _send_header(self, header: object) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(header)), dtype=torch.uint8).to(self.device)
        self._broadcast(torch.tensor([payload.numel()], dtype=torch.int64, device=self.device))
        self._broadcast(payload)

    def _receive_header(self) -> object:
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(size)
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(payload)
        return pickle.loads(payload.cpu().numpy().tobytes())

    def send(self, groups: Iterable[list[Named]]) -> int:
        """Rank 0: every group of named tensors, bucket by bucket; returns the bytes sent."""
        sent = 0
        for group in groups:
            for run in dtype_runs(group):
                flat = flatten(run, device=self.device)
                self._send_header(([n for n, _ in run], [tuple(t.shape) for _, t in run], flat.dtype))
                self._broadcast(flat)
                sent += flat.numel() * flat.element_size()
        self._send_header(None)
        return sent

    def receive(self) -> Iterator[Named]:
        """Ranks 1..K: named tensors as they arrive (views into each bucket, valid until the next one)."""
        while (header := self._receive_header()) is not None:
            names, shapes, dtype = header
            numel = sum(int(torch.Size(s).numel()) for s in shapes)
            flat = torch.empty(numel, dtype=dtype, device=self.device)
            self._broadcast(flat)
            yield from split_flat(flat, names, shapes)
