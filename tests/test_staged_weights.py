"""Staging a weight chunk in shared memory for a tensor-parallel engine's workers (actors/staged_weights.py): what a
worker reads back equals what was written, for every dtype and odd sizes; the file is gone afterwards, also after a
failed load; a /dev/shm too small for the chunk is not used."""

from __future__ import annotations

import os

import pytest
import torch

from rlhf_ray.actors import staged_weights
from rlhf_ray.actors.staged_weights import ALIGN, load_staged, staged


class RecordingWorker:
    """Stands in for a vLLM worker: `reload_weights` reads the views as a weight loader does (narrowed copies)."""

    def __init__(self, fail: bool = False):
        self.loaded: dict[str, torch.Tensor] = {}
        self.fail = fail

    def reload_weights(self, weights_iterator):
        for name, view in weights_iterator:
            self.loaded[name] = view.clone()
        if self.fail:
            raise RuntimeError("loader failed")


def chunk() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("model.layers.0.q.weight", torch.randn(33, 7, generator=g)),
            ("model.layers.0.norm.weight", torch.randn(5, generator=g).to(torch.bfloat16)),
            ("model.layers.0.k.weight", torch.randn(6, 4, generator=g).t()),  # not contiguous
            ("model.layers.0.bias", torch.arange(3, dtype=torch.int64)),
            ("model.layers.0.scale", torch.tensor(2.5, dtype=torch.float16))]


def test_a_worker_reads_back_every_tensor_exactly_and_the_file_is_removed():
    tensors = chunk()
    worker = RecordingWorker()
    with staged(tensors) as toc:
        assert all(offset % ALIGN == 0 for offset in toc.offsets)
        assert os.path.getsize(toc.path) == toc.nbytes
        taken = load_staged(worker, toc)
    assert not os.path.exists(toc.path)
    assert taken["tensors"] == len(tensors) and taken["copied"] == 0 and 0 < taken["mapped"]
    for name, tensor in tensors:
        got = worker.loaded[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor)


def test_a_failed_load_leaves_no_file():
    with pytest.raises(RuntimeError, match="loader failed"):
        with staged(chunk()) as toc:
            load_staged(RecordingWorker(fail=True), toc)
    assert not os.path.exists(toc.path)


def test_a_loader_writing_into_a_view_changes_only_its_own_copy():
    class Scribbler(RecordingWorker):
        def reload_weights(self, weights_iterator):
            for name, view in weights_iterator:
                view.zero_()  # a loader that writes in place
                self.loaded[name] = view

    tensors = chunk()[:1]
    with staged(tensors) as toc:
        taken = load_staged(Scribbler(), toc)
        second = RecordingWorker()
        load_staged(second, toc)  # the next worker still reads the learner's values
    assert taken["copied"] > 0
    assert torch.equal(second.loaded[tensors[0][0]], tensors[0][1])


def test_a_small_dev_shm_is_not_used(monkeypatch, tmp_path):
    class Tiny:
        f_bavail, f_frsize = 16, 4096  # 64 KiB free

    monkeypatch.setattr(staged_weights.os, "statvfs", lambda path: Tiny())
    assert staged_weights.staging_dir(2**20) != "/dev/shm"
    assert staged_weights.staging_dir(1024) == ("/dev/shm" if os.access("/dev/shm", os.W_OK) else
                                                staged_weights.tempfile.gettempdir())
