"""Staging a weight update in shared memory for a tensor-parallel engine's workers (actors/staged_weights.py): chunks
keep whole layers together; what a worker reads back equals what was written, for every dtype and odd sizes; each
file is gone once its chunk is loaded, also after a failed load; a /dev/shm too small for a chunk is not used."""

from __future__ import annotations

import os

import pytest
import torch

from rlhf_ray.actors.staged_weights import load_staged, staged_chunks
from rlhf_ray.models import shared_tensors
from rlhf_ray.models.shared_tensors import ALIGN
from rlhf_ray.models.weight_buckets import layer_of


class RecordingWorker:
    """Stands in for a vLLM worker: `reload_weights` copies what it reads from the views."""

    def __init__(self, fail: bool = False):
        self.loaded: dict[str, torch.Tensor] = {}
        self.fail = fail

    def reload_weights(self, weights_iterator):
        for name, view in weights_iterator:
            self.loaded[name] = view.clone()
        if self.fail:
            raise RuntimeError("loader failed")


def odd_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("model.layers.0.q.weight", torch.randn(33, 7, generator=g)),
            ("model.layers.0.norm.weight", torch.randn(5, generator=g).to(torch.bfloat16)),
            ("model.layers.0.k.weight", torch.randn(6, 4, generator=g).t()),  # not contiguous
            ("model.layers.0.bias", torch.arange(3, dtype=torch.int64)),
            ("model.layers.0.scale", torch.tensor(2.5, dtype=torch.float16))]


def test_chunks_keep_whole_layers_together():
    assert layer_of("model.layers.12.mlp.up_proj.weight") == "model.layers.12"
    assert layer_of("model.embed_tokens.weight") == "model.embed_tokens.weight"
    mb = torch.zeros(2**18)  # 1 MiB of fp32
    stream = [("model.embed_tokens.weight", mb)] + [(f"model.layers.{i}.{part}.weight", mb)
                                                   for i in range(3) for part in ("q", "k", "v")] + [
        ("model.norm.weight", torch.zeros(4))]
    chunks = [toc.names for toc in staged_chunks(iter(stream), chunk_bytes=2 * 2**20)]
    assert [name for names in chunks for name in names] == [name for name, _ in stream]  # nothing lost or moved
    for names in chunks:  # a layer's tensors all in one chunk
        layers = {layer_of(name) for name in names}
        for other in chunks:
            if other is not names:
                assert not layers & {layer_of(name) for name in other}
    assert [len(c) for c in chunks] == [4, 3, 3, 1]  # embedding + layer 0 (2 MiB reached inside it), 1, 2, norm


def test_a_worker_reads_back_every_tensor_exactly_and_each_file_goes_with_its_chunk():
    tensors = odd_tensors()
    worker, paths = RecordingWorker(), []
    for toc in staged_chunks(iter(tensors), chunk_bytes=1):  # one layer: one chunk
        assert all(offset % ALIGN == 0 for offset in toc.offsets)
        assert os.path.getsize(toc.path) == toc.nbytes
        taken = load_staged(worker, toc)
        paths.append(toc.path)
    assert len(paths) == 1 and not os.path.exists(paths[0])
    assert taken["tensors"] == len(tensors) and taken["copied"] == 0 and 0 < taken["mapped"]
    for name, tensor in tensors:
        got = worker.loaded[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor)


def test_a_failed_load_leaves_no_file():
    stream = staged_chunks(iter(odd_tensors()), chunk_bytes=1)
    toc = next(stream)
    with pytest.raises(RuntimeError, match="loader failed"):
        try:
            load_staged(RecordingWorker(fail=True), toc)
        finally:
            stream.close()  # the engine's loop unwinding
    assert not os.path.exists(toc.path)


def test_a_loader_writing_into_a_view_changes_only_its_own_copy():
    class Scribbler(RecordingWorker):
        def reload_weights(self, weights_iterator):
            for name, view in weights_iterator:
                view.zero_()  # a loader that writes in place
                self.loaded[name] = view

    name, tensor = odd_tensors()[0]
    for toc in staged_chunks(iter([(name, tensor)]), chunk_bytes=1):
        taken = load_staged(Scribbler(), toc)
        second = RecordingWorker()
        load_staged(second, toc)  # the next worker still reads the learner's values
    assert taken["copied"] > 0
    assert torch.equal(second.loaded[name], tensor)


def test_a_small_dev_shm_is_not_used(monkeypatch):
    class Tiny:
        f_bavail, f_frsize = 16, 4096  # 64 KiB free

    monkeypatch.setattr(shared_tensors.os, "statvfs", lambda path: Tiny())
    assert shared_tensors.staging_dir(2**20) != "/dev/shm"
    assert shared_tensors.staging_dir(1024) == ("/dev/shm" if os.access("/dev/shm", os.W_OK) else
                                                shared_tensors.tempfile.gettempdir())


def test_a_full_staging_folder_names_the_tensor_and_the_fix(monkeypatch, tmp_path):
    def full(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shared_tensors.os, "pwrite", full)
    with pytest.raises(OSError, match=r"staging model.layers.0.q.weight \(0 MiB\) .*No space left on device; give "
                                      r"/dev/shm \(or TMPDIR\) room for one weight chunk"):
        list(staged_chunks(iter(odd_tensors()), chunk_bytes=1, directory=str(tmp_path)))
    assert list(tmp_path.iterdir()) == []  # the half-written file is removed
