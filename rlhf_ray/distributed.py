"""The distributed plumbing every multi-process role shares: the environment of an actor's process (threads, the
CPU accelerator), rendezvous on a socket only the host holds, a process group's store and backend, and the ZeRO-3
inference setup of sharded forward-only roles. No Ray actor code here: learners and actors both build on it."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import socket
from collections.abc import Callable

import torch

from rlhf_ray.config.deepspeed import DeepSpeedSpec
from rlhf_ray.config.model import ModelSpec
from rlhf_ray.config.placement import PlacementSpec


def threads(placement: PlacementSpec) -> int:
    return placement.threads or max(1, math.floor(placement.num_cpus))


@contextlib.contextmanager
def torch_threads(n: int | None):
    """torch's intra-op threads at `n` for the block (None: as they are), restored after."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def actor_env(placement: PlacementSpec) -> dict[str, str]:
    """CPU ranks run DeepSpeed's CPU accelerator; torch threads match the CPUs reserved for the rank."""
    env = {"OMP_NUM_THREADS": str(threads(placement))}
    if placement.num_gpus == 0:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def on_gpu() -> bool:
    return torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"


def interface_of(address: str) -> str:
    """The name of this host's network interface that holds `address` (exactly, else within its subnet: 127.0.0.2 is
    on `lo`). Raises naming the interfaces there are, for an address this host does not have."""
    import ipaddress

    import psutil

    ip = ipaddress.ip_address(address)
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    found = {name: [a for a in addrs if a.family == family] for name, addrs in psutil.net_if_addrs().items()}
    for name, addrs in found.items():
        if any(ipaddress.ip_address(a.address.split("%")[0]) == ip for a in addrs):
            return name
    for name, addrs in found.items():
        for a in addrs:
            if a.netmask and ip in ipaddress.ip_network(f"{a.address.split('%')[0]}/{a.netmask}", strict=False):
                return name
    have = ", ".join(f"{n} {'/'.join(a.address for a in addrs)}" for n, addrs in found.items() if addrs)
    raise RuntimeError(f"no network interface of this host holds its Ray node address {address} (interfaces: "
                       f"{have}); start the Ray node with --node-ip-address set to one of them")


def bind_to_node_address() -> dict[str, str]:
    """Make the process groups this process forms (gloo, NCCL's sockets) use the interface of this node's Ray
    address. Left alone, gloo advertises the address the host name resolves to, which on many machines is 127.0.1.1
    or 127.0.0.1 (Debian's and Ubuntu's /etc/hosts): ranks on two hosts then tell each other to connect to loopback
    and the rendezvous fails. A variable the user set is kept. Returns what was set."""
    import ray

    address = ray.util.get_node_ip_address()
    name = interface_of(address)
    wanted = {"GLOO_SOCKET_IFNAME": name}
    if on_gpu() and not address.startswith("127."):
        wanted["NCCL_SOCKET_IFNAME"] = f"={name}"  # '=': this interface exactly, not every one starting so
    chosen = {k: v for k, v in wanted.items() if not os.environ.get(k)}
    os.environ.update(chosen)
    return chosen


def listen(host: str) -> socket.socket:
    """A listening socket on `host` (this node's Ray address: 127.0.0.1 on a local cluster) and a free port, for
    a rendezvous store to take over. torch's TCPStore given only a host and port listens on every interface."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    return sock


class RendezvousHost:
    """A member of a process group that may host its rendezvous (rank 0 of a learner group or of a sharded
    inference group): it hands out its node address and a port it keeps listening on until the group's store
    takes the socket over, so no other process can take the port meanwhile."""

    _listeners: dict[int, socket.socket]

    def rendezvous_address(self) -> tuple[str, int]:
        """This rank's node address and a free port, for a process group it hosts."""
        import ray

        listener = listen(ray.util.get_node_ip_address())
        host, port = listener.getsockname()[:2]
        if not hasattr(self, "_listeners"):
            self._listeners = {}
        self._listeners[port] = listener
        return host, port

    def take_listener(self, port: int) -> socket.socket | None:
        return getattr(self, "_listeners", {}).pop(port, None)


def rendezvous_store(host: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta,
                     listener: socket.socket | None = None):
    """The TCPStore of a process group: rank 0 serves it on `listener` (bound to `host` only), the others connect."""
    import torch.distributed as dist

    if rank == 0:
        if listener is None:
            raise RuntimeError(f"rank 0 of the group at {host}:{port} has no listening socket; call "
                               "rendezvous_address on it first")
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                             master_listen_fd=listener.detach())  # the store owns the socket from here on
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)


def all_reduce(values: list[float], op: str, device: torch.device) -> list[float]:
    """`values` reduced over the default process group (op: "SUM", "MAX", ...), as float64 on `device`."""
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op))
    return tensor.tolist()


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int,
                       listener: socket.socket | None = None, timeout_s: float = 1800.0) -> None:
    """One torch.distributed world per learner group (NCCL on GPUs, gloo on CPU), its store bound to the master's
    address only. Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU, so the local device is always 0."""
    import deepspeed
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    bind_to_node_address()
    if on_gpu():
        torch.cuda.set_device(0)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = rendezvous_store(master_addr, master_port, rank, world_size, timeout, listener)
    backend = "nccl" if on_gpu() else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    without_shm_all_reduce_kernel()
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)  # adopts the group above


def without_shm_all_reduce_kernel() -> None:
    """DeepSpeed's communication backend, set up on the CPU accelerator, JIT-compiles a shared-memory all-reduce
    kernel (C++ with OpenMP: ~1 minute on 2 cores at a process's first use on a machine, again whenever the
    environment's path changes, and a failed start where no C++ compiler is installed). It serves only
    `inference_all_reduce` (DeepSpeed's AutoTP inference), which nothing here calls: the learners' and sharded
    scorers' collectives are torch.distributed's (gloo on CPU), so the backend is set up without it. On a GPU
    DeepSpeed has no such kernel to build, and this changes nothing."""
    import importlib

    # by module name: the attribute `deepspeed.comm.torch` is torch itself (the package imports torch over it)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def build_zero3_inference(load: Callable[[], torch.nn.Module], spec: ModelSpec, micro_batch_size: int,
                           world_size: int, ds: DeepSpeedSpec | None = None):
    """ZeRO-3 inference (no optimizer): the model's weights are partitioned over the group's ranks as they load
    (transformers builds them under zero.Init while the returned HfDeepSpeedConfig is alive: keep it) and gathered
    layer by layer during each forward. Returns (engine, that config)."""
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    ds = ds or DeepSpeedSpec(zero_stage=3)
    config = ds.model_copy(update={"zero_stage": 3}).to_ds_config(spec.dtype, micro_batch_size, world_size)
    hf_config = HfDeepSpeedConfig(config)
    model = load()
    model.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=config, dist_init_required=False)
    engine.eval()
    return engine, hf_config
