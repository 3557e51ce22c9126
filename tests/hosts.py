"""Real hosts on one machine, for tests of jobs that span machines: each host is a network namespace with an address
of its own (10.231.0.N on interface eth1, joined by a bridge in a switch namespace) and its own private folder
`<root>/local` (a tmpfs in its own mount namespace: storage the other hosts do not see), while the rest of the
file system is shared, as a cluster's shared storage is. The host name resolves to loopback in every host, as on
many VMs. Every process of a host is ended by pid when it is lost or when the hosts are closed; the addresses
exist only inside the namespaces made here. Needs root and `ip`, `nsenter`, `unshare` (util-linux)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.231.0"


def unavailable() -> str | None:
    """Why these hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "nsenter", "unshare", "mount") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed"
    probe = f"rlhf-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", netns, "ip"] if netns else ["ip"]) + list(args)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


@dataclass
class Host:
    name: str
    netns: str
    address: str
    init: subprocess.Popen | None = None
    """A process that holds the host's mount namespace (its private `local` folder); commands join it."""

    def pids(self) -> list[int]:
        done = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True)
        return [int(p) for p in done.stdout.split()]


class Hosts:
    """Hosts h1, h2, ... made on demand (`add`), each a Ray node once `start_ray` ran there."""

    def __init__(self, root: Path, env: dict[str, str]):
        self.root = root
        self.tag = uuid.uuid4().hex[:5]
        self.switch = f"rlhf-sw-{self.tag}"
        self.hosts: dict[str, Host] = {}
        self.env = env
        self.local = root / "local"
        self.local.mkdir(parents=True, exist_ok=True)
        subprocess.run(["ip", "netns", "add", self.switch], check=True)
        _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        _ip("link", "set", "br0", "up", netns=self.switch)

    def add(self, name: str) -> Host:
        """A new host on the switch, with address SUBNET.<n> (n counts hosts ever made, so a replacement machine
        gets an address of its own)."""
        n = len(self.hosts) + 1
        host = Host(name, f"rlhf-{name}-{self.tag}", f"{SUBNET}.{n}")
        subprocess.run(["ip", "netns", "add", host.netns], check=True)
        outer, inner = f"s{self.tag}{n}", f"h{self.tag}{n}"
        _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
        _ip("link", "set", outer, "netns", self.switch)
        _ip("link", "set", outer, "master", "br0", netns=self.switch)
        _ip("link", "set", outer, "up", netns=self.switch)
        _ip("link", "set", inner, "netns", host.netns)
        _ip("link", "set", inner, "name", "eth1", netns=host.netns)
        _ip("addr", "add", f"{host.address}/24", "dev", "eth1", netns=host.netns)
        _ip("link", "set", "eth1", "up", netns=host.netns)
        _ip("link", "set", "lo", "up", netns=host.netns)
        # the host's own mount namespace, with a private tmpfs over <root>/local, held by a sleeping process
        host.init = subprocess.Popen(["ip", "netns", "exec", host.netns, "unshare", "--mount", "--propagation",
                                      "private", "sh", "-c",
                                      f"mount -t tmpfs tmpfs {self.local} && echo ready && exec sleep infinity"],
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        if host.init.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{name}: could not mount its private folder {self.local}")
        self.hosts[name] = host
        return host

    def command(self, host: Host, argv: list[str], cwd: Path | None = None) -> list[str]:
        """`argv` as a command run on `host` (its network, its mounts), in `cwd`. `ip netns exec` and `unshare`
        exec (no fork), so the holder's pid is the namespaces' pid. The folder is entered inside the host's mounts
        (nsenter's --wd would open it before, outside them); a process that kept its folder from outside would find
        it unreachable (getcwd fails), so every command enters one, `self.root` by default."""
        cd = ["sh", "-c", 'cd "$0" && exec "$@"', str(cwd or self.root)]
        return ["nsenter", "-t", str(host.init.pid), "-m", "-n", "--", *cd, *argv]

    def run(self, host: Host, argv: list[str], cwd: Path | None = None, env: dict | None = None,
            timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        """`argv` on `host`, to the end (at most `timeout` s); its output in the result."""
        done = subprocess.run(self.command(host, argv, cwd), env={**self.env, **(env or {})}, capture_output=True,
                              text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"on {host.name}: {' '.join(argv)} exited {done.returncode}\n"
                                 f"{done.stdout[-4000:]}\n{done.stderr[-6000:]}")
        return done

    def popen(self, host: Host, argv: list[str], cwd: Path | None = None, env: dict | None = None,
              log: Path | None = None) -> subprocess.Popen:
        out = open(log, "w") if log else subprocess.DEVNULL
        return subprocess.Popen(self.command(host, argv, cwd), env={**self.env, **(env or {})}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def start_ray(self, host: Host, head: Host | None, cpus: int, port: int = 6379) -> None:
        """A Ray node on `host`: the head (head None) or a worker joining `head`. Its temporary folder (sessions,
        logs, sockets, unpacked working folders; the head's choice, taken by every node) is inside each host's
        private folder, as each machine has its own: two runtime-env agents sharing one folder would unpack a job's
        working folder over each other. A lost node is marked dead after 3 missed 1-s health checks (Ray's default
        is 5 of 3 s)."""
        ray = str(Path(os.environ.get("VIRTUAL_ENV", Path(__import__("sys").executable).parent.parent)) / "bin/ray")
        common = ["--node-ip-address", host.address, "--num-cpus", str(cpus), "--disable-usage-stats"]
        if head is None:
            argv = [ray, "start", "--head", "--port", str(port), "--dashboard-host", host.address,
                    "--dashboard-port", "8265", "--temp-dir", str(self.local / "ray"),
                    "--system-config", '{"health_check_period_ms": 1000, "health_check_timeout_ms": 1000, '
                                       '"health_check_failure_threshold": 3}', *common]
        else:
            argv = [ray, "start", "--address", f"{head.address}:{port}", *common]
        self.run(host, argv, timeout=180)

    def lose(self, host: Host) -> None:
        """The machine dies: every process of the host killed at once, its link down."""
        for pid in host.pids():
            _kill(pid)
        _ip("link", "set", "eth1", "down", netns=host.netns)

    def close(self) -> None:
        for host in self.hosts.values():
            for pid in host.pids():
                _kill(pid)
            if host.init is not None:
                _kill(host.init.pid)
                host.init.wait(timeout=10)
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
