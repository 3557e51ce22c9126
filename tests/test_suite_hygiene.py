"""The test suite cleans up after itself: a full run writes ~12 GB of models and checkpoints under tmp_path, and a
machine that keeps every run's (pytest's default) fills its disk in a few runs. Passed tests' folders go when they
end; a failed test's stays for reading."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TESTS = '''
def test_passes(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"0" * 1024)

def test_fails(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"0" * 1024)
    assert False
'''


def test_a_passed_tests_tmp_path_is_removed_and_a_failed_ones_kept(tmp_path):
    (tmp_path / "test_two.py").write_text(TESTS)
    temp_root = tmp_path / "temproot"
    temp_root.mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path),
         "-p", "no:cacheprovider", "-p", "no:randomly", "-q", str(tmp_path / "test_two.py")],
        env={"PATH": "/usr/bin:/bin", "PYTEST_DEBUG_TEMPROOT": str(temp_root)},
        capture_output=True, text=True, timeout=120)
    assert "1 failed, 1 passed" in run.stdout, run.stdout + run.stderr
    left = sorted(p.parent.name for p in temp_root.rglob("weights.bin"))
    assert left == ["test_fails0"], left


CRASHES_IN_FINALIZATION = '''
import os, signal


class CrashOnTeardown:
    """A module global whose teardown crashes, as a C extension's thread once did after every test had passed."""

    def __del__(self, kill=os.kill, pid=os.getpid(), signal=signal.SIGSEGV):  # bound now: teardown clears modules
        kill(pid, signal)


LEFT_FOR_TEARDOWN = CrashOnTeardown()


def test_passes():
    pass
'''


def test_the_run_exits_with_pytests_status_whatever_the_interpreters_teardown_does(tmp_path):
    """tests/clean_exit.py: the process ends after pytest's last hook with pytest's status (0 here, 1 with a failed
    test), not with a crash in Python's module teardown (-11: SIGSEGV, without the hooks)."""
    (tmp_path / "test_teardown.py").write_text(CRASHES_IN_FINALIZATION)
    (tmp_path / "test_fails.py").write_text("def test_fails():\n    assert False\n")

    def run(*files: str, plugin: bool = True) -> int:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path),
             "-p", "no:cacheprovider", "-p", "no:randomly", *(["-p", "tests.clean_exit"] if plugin else []), "-q",
             *(str(tmp_path / f) for f in files)],
            cwd=REPO, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
            timeout=120).returncode

    assert run("test_teardown.py", plugin=False) == -11  # the crash this guards against
    assert run("test_teardown.py") == 0
    assert run("test_teardown.py", "test_fails.py") == 1
