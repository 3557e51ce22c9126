"""The embedded Ray goes with its driver. A job that starts Ray in-process (the default on one machine) also starts
this small watcher; if the driver dies without shutting Ray down (kill -9, OOM killer, a lost terminal), the
watcher kills every process the driver had started, at once. Without it Ray's dashboard agent and runtime-env
agent outlive the driver by about a minute, holding the agent's port, and a Ray started meanwhile takes no jobs.

    python -m rlhf_ray.orphan_guard DRIVER_PID    (started by rlhf_ray.cluster; stdin is a pipe from the driver)

The watcher learns the driver's descendants by polling, and notices the driver's death by the end of its stdin
(the pipe's write end lives in the driver only) or by polling the PID."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

POLL_S = 1.0


def start(driver_pid: int | None = None) -> subprocess.Popen:
    """Start the watcher for this process; `stop` it on a clean exit."""
    return subprocess.Popen([sys.executable, "-m", "rlhf_ray.orphan_guard", str(driver_pid or os.getpid())],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # not in the driver's process group: a Ctrl-C reaches Ray only


def stop(guard: subprocess.Popen) -> None:
    """A clean shutdown: the driver has stopped Ray itself, so the watcher leaves without killing anything."""
    try:
        guard.stdin.write(b"done\n")
        guard.stdin.close()
        guard.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        guard.kill()


def watch(driver_pid: int) -> int:
    import psutil

    me = os.getpid()
    driver = psutil.Process(driver_pid)
    known: dict[int, float] = {}  # pid -> create_time, so a reused PID is never killed
    while True:
        try:
            for child in driver.children(recursive=True):
                if child.pid != me:
                    known.setdefault(child.pid, child.create_time())
        except psutil.NoSuchProcess:
            break
        ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if ready:
            line = sys.stdin.readline()
            if line.strip() == "done":
                return 0  # clean exit: the driver shut Ray down itself
            break  # end of file: the driver is gone
        if not driver.is_running():
            break
    for pid, created in known.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == created:
                proc.send_signal(signal.SIGKILL)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return 0


if __name__ == "__main__":
    sys.exit(watch(int(sys.argv[1])))
