"""What a role's process really holds: its peak memory above a baseline taken when the role started (the Python,
torch and library runtime, which the memory model does not count), to set beside the plan's prediction. On a GPU
the CUDA allocator's peak (the runtime holds none of it); on CPU the peak resident set (VmHWM, reset to the
current resident set at the baseline where the kernel allows it)."""

from __future__ import annotations

from pathlib import Path

import torch


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


class PeakMemory:
    """Made when a role's actor starts, before its model exists; `peak()` any time after."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            self.baseline = 0
            if torch.cuda.is_initialized():
                torch.cuda.reset_peak_memory_stats()
                self.baseline = torch.cuda.memory_allocated()
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        except OSError:  # not allowed here (some container runtimes): the peak then counts from the process start
            pass
        self.baseline = _status_bytes("VmRSS")

    def peak(self) -> dict:
        """{"bytes": the peak above the baseline, "baseline": bytes, "device": "cuda" or "cpu"}."""
        if self.cuda:
            top = torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else 0
            return {"bytes": max(0, top - self.baseline), "baseline": self.baseline, "device": "cuda"}
        return {"bytes": max(0, _status_bytes("VmHWM") - self.baseline), "baseline": self.baseline, "device": "cpu"}
