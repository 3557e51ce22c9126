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
