"""End the pytest process as soon as pytest is done, with pytest's exit status, skipping the interpreter's
finalization. A fresh-clone run of the whole suite once ended with every test passed and then a segmentation fault
(exit 139, so CI failed): the kernel log named a non-main thread jumping to freed memory while Python tore its
modules down (a C extension's thread: Ray's, torch's or vLLM's). Nothing of the suite runs after pytest's last hook,
so the process exits there: atexit handlers still run, module teardown does not. conftest.py imports these hooks."""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

import pytest

_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    status = config.stash.get(_STATUS, None)
    if status is None or Path(sys.argv[0]).name not in ("pytest", "py.test", "__main__.py"):
        return  # pytest.main() inside another program: its process is not ours to end
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
