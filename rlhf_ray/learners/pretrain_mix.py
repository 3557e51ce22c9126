"""The pretraining mix of PPO-ptx (InstructGPT's gamma term): every PPO mini-batch comes with a batch of plain
text from mmap corpora, on which the policy also keeps its language-model loss, so RLHF does not unlearn it."""

from __future__ import annotations

import torch

from rlhf_ray.data.sampler import MixedCorpus, ProportionalSampler, shard
from rlhf_ray.data.tokenized import IGNORE_INDEX


class PretrainMix:
    """Global batch k of the mix is a pure function of (seed, k), so a resumed run continues the same sequence."""

    def __init__(self, prefixes: list[str], global_batch_size: int, seed: int, pad_token_id: int):
        self.corpus = MixedCorpus.open(prefixes)
        self.sampler = ProportionalSampler(self.corpus.sizes, [1.0] * len(prefixes), global_batch_size, seed)
        self.pad = pad_token_id

    def micro_batches(self, k: int, rank: int, world_size: int, micro_batch_size: int) -> list[dict]:
        """This rank's share of global batch k, padded on the right, in micro-batches."""
        rows = [torch.as_tensor(a.astype("int64")) for a in self.corpus.fetch(shard(self.sampler.batch(k), rank,
                                                                                    world_size))]
        out = []
        for start in range(0, len(rows), micro_batch_size):
            part = rows[start: start + micro_batch_size]
            width = max(len(r) for r in part)
            ids = torch.full((len(part), width), self.pad, dtype=torch.long)
            labels = torch.full_like(ids, IGNORE_INDEX)
            mask = torch.zeros_like(ids)
            for i, r in enumerate(part):
                ids[i, : len(r)], labels[i, : len(r)], mask[i, : len(r)] = r, r, 1
            out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
        return out

