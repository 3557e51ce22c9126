"""Pre-flight checks: every file a job reads, checked before Ray starts (by `rlhf-ray validate` and at the start of
every job). Each problem is one line, `file:line: field: what is wrong; the fix`, so a broken input costs seconds
and names itself instead of failing inside an actor minutes later."""

from __future__ import annotations

import inspect
import json
import os
import struct
from pathlib import Path
from typing import Iterator

from pydantic import BaseModel
from rich.console import Console

from rlhf_ray.config import ConfigError, ConfigSource, JobBase
from rlhf_ray.config.jobs import FINAL_MODEL_DIR
from rlhf_ray.config.pipeline_job import ANSWERS_FILE, PAIRS_DIR
from rlhf_ray.config.model import ModelSpec
from rlhf_ray.config.paths import looks_local
from rlhf_ray.memory.budget import check_memory, written_shapes
from rlhf_ray.plan import ResourcePlan, describe_nodes, nodes_from_shape

Loc = tuple[str, ...]


def stages(job: JobBase) -> list[tuple[Loc, JobBase]]:
    """(field prefix, job) for each stage: one for a plain job, sft / warmup / rm / ppo ... for a pipeline."""
    return [((name,) if name else (), stage) for name, stage in job.named_stages().items()]


def preflight(job: JobBase, source: ConfigSource, files: bool = True) -> None:
    """Run every check; raise one ConfigError listing all problems found (none: return quietly). `files=False`
    checks what the config names (datasets, reward functions, engines) but not the files it reads, for a config
    whose inputs do not exist yet (a PPO config before its SFT stage has run)."""
    produced = {_norm(Path(stage.output_dir) / FINAL_MODEL_DIR) for _, stage in stages(job)}
    if (warmup := getattr(job, "warmup", None)) is not None:
        produced.add(_norm(Path(warmup.output_dir) / ANSWERS_FILE))  # the pipeline samples it before the warm-up
    if getattr(job, "pairs", None) is not None:
        produced.add(_norm(Path(job.rm.output_dir) / PAIRS_DIR))  # labelled before the rm stage
    problems: list[str] = []
    for prefix, stage in stages(job):
        found = [*check_datasets(stage, files, produced), *check_reward_function(stage), *check_environment(stage),
                 *check_keep_best(stage)]
        if files:
            found += [*check_output_dir(stage), *check_checkpoint(stage), *check_corpora(stage),
                      *check_model_folders(stage, produced)]
        problems += [f"{source.where(prefix + loc)}: {'.'.join(prefix + loc)}: {what}" for loc, what in found]
    if (pairs := getattr(job, "pairs", None)) is not None:
        problems += [f"{source.where(loc)}: {'.'.join(loc)}: {what}"
                     for loc, what in check_function(("pairs", "gold_function"), pairs.gold_function)]
    problems += check_engines(job, source, files)
    if problems:
        raise ConfigError(problems)


# --- output and checkpoints ----------------------------------------------------------------------------------


def check_output_dir(job: JobBase) -> Iterator[tuple[Loc, str]]:
    out = Path(job.output_dir)
    if out.exists() and not out.is_dir():
        yield ("output_dir",), f"{out} is a file, not a folder; set output_dir to a folder (new or existing)"
        return
    existing = next((p for p in [out, *out.parents] if p.exists()), Path("."))
    if not existing.is_dir():
        yield ("output_dir",), f"{existing} is a file, so {out} cannot be created; choose another output_dir"
    elif not os.access(existing, os.W_OK | os.X_OK):
        yield ("output_dir",), f"{existing} is not writable by this user; choose another output_dir"


def check_checkpoint(job: JobBase) -> Iterator[tuple[Loc, str]]:
    """The checkpoint a job would resume from must have a readable state (sealed ones always have a state file)."""
    from rlhf_ray.jobs.checkpoints import STATE_FILE, Checkpoints

    if not job.checkpoint.resume or not Path(job.output_dir).is_dir():
        return
    latest = Checkpoints(job.output_dir, job.checkpoint.keep_last).latest()
    if latest is None:
        return
    try:
        state = Checkpoints.state(latest)
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise ValueError("it has no integer 'step'")
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        yield ("checkpoint", "resume"), (
            f"the newest checkpoint's state {latest / STATE_FILE} is unreadable ({exc}); move {latest} away to "
            "resume from the one before it, or set checkpoint.resume: false to start over")


# --- data ------------------------------------------------------------------------------------------------------


def check_datasets(job: JobBase, files: bool = True, produced: set[str] = frozenset()
                   ) -> Iterator[tuple[Loc, str]]:
    """Dataset names and formats (cheap), and local dataset files read through once (the first bad line); files
    an earlier pipeline stage writes (`produced`) are not read."""
    from rlhf_ray.data.errors import DataError
    from rlhf_ray.data.registry import load_raw, resolve_adapter

    data = getattr(job, "data", None)
    for i, dataset in enumerate(getattr(data, "datasets", [])):
        loc: Loc = ("data", "datasets", str(i))
        try:
            resolve_adapter(dataset)
            if files and dataset.path is not None and _norm(Path(dataset.path)) not in produced:
                if not Path(dataset.path).exists():
                    yield loc + ("path",), f"no such file or folder {dataset.path!r}; fix the path"
                    continue
                load_raw(dataset)
        except DataError as exc:
            yield loc + ((exc.field or "name"),), str(exc)


def check_corpora(job: JobBase) -> Iterator[tuple[Loc, str]]:
    """The mmap corpora a job trains on (a pretrain job's data.corpora, PPO's pretrain_data): both files there and
    whole, not empty, and written with the model's tokenizer (see open_for_tokenizer)."""
    from rlhf_ray.data.errors import DataError
    from rlhf_ray.data.mmap_corpus import open_for_tokenizer

    data, ppo = getattr(job, "data", None), getattr(job, "ppo", None)
    if ppo is not None:
        corpora = [(("ppo", "pretrain_data", str(i)), prefix) for i, prefix in enumerate(ppo.pretrain_data)]
        model = job.policy.model
    elif hasattr(data, "corpora"):
        corpora = [(("data", "corpora", str(i), "path"), c.path) for i, c in enumerate(data.corpora)]
        model = job.model
    else:
        return
    if not corpora:
        return
    size = _tokenizer_size(model)
    for loc, prefix in corpora:
        try:
            open_for_tokenizer(prefix, size)
        except (OSError, DataError) as exc:
            yield loc, f"{exc}; write the corpus with `rlhf-ray preprocess`"


def _tokenizer_size(spec: ModelSpec) -> int | None:
    """len(tokenizer) of a model in a local folder; None when it is not there yet (a hub id, a GGUF file, a folder
    an earlier stage writes) or does not load (check_model_folders reports that)."""
    path = spec.tokenizer_path
    if spec.gguf_file is not None or path is None or not (Path(path) / "tokenizer_config.json").is_file():
        return None
    try:
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(path, trust_remote_code=spec.trust_remote_code))
    except Exception:  # noqa: BLE001 - reported by check_model_folders
        return None


# --- reward function --------------------------------------------------------------------------------------------


def check_reward_function(job: JobBase) -> Iterator[tuple[Loc, str]]:
    """`reward.function` (and `ppo.accuracy_function`) import and take (prompts, answers, **columns)."""
    names = [(("reward", "function"), getattr(getattr(job, "reward", None), "function", None)),
             (("ppo", "accuracy_function"), getattr(getattr(job, "ppo", None), "accuracy_function", None))]
    for loc, name in names:
        if name:
            yield from check_function(loc, name)


def check_function(loc: Loc, name: str) -> Iterator[tuple[Loc, str]]:
    """The function named at `loc` imports and can be called as f(prompts, answers, **columns)."""
    from rlhf_ray.functions import load_function

    try:
        function = load_function(name)
    except Exception as exc:  # the module's own import may raise anything
        module = name.partition(":")[0]
        yield loc, f"{exc}; check the spelling and that {module!r} is importable from the job's working dir"
        return
    if not callable(function):
        yield loc, f"{name} is a {type(function).__name__}, not a function"
        return
    try:
        inspect.signature(function).bind(["prompt"], ["answer"])
    except TypeError as exc:
        if "missing" not in str(exc):  # a required column (e.g. answer=) is checked against the data later
            yield loc, (f"{name} cannot be called as f(prompts, answers, **columns): {exc}; give it two "
                        "positional parameters (lists of prompts and answers) and take dataset columns as "
                        "keyword arguments")
    except ValueError:
        pass  # a builtin without a signature: it will be called and judged then


def check_keep_best(job: JobBase) -> Iterator[tuple[Loc, str]]:
    """`ppo.keep_best` by task accuracy needs a rule to score it: `ppo.accuracy_function` or the dataset's own."""
    from rlhf_ray.data.registry import data_rule

    ppo = getattr(job, "ppo", None)
    metric = getattr(ppo, "keep_best", None)
    if metric is None or not metric.endswith("task_accuracy") or ppo.accuracy_function:
        return
    if data_rule(job.data.datasets) is None:
        names = ", ".join(d.name for d in job.data.datasets)
        yield ("ppo", "keep_best"), (f"{metric} needs a rule that marks answers right, and the data ({names}) "
                                     f"has none of its own: set ppo.accuracy_function "
                                     "(e.g. rlhf_ray.data.answers:last_number_reward), or keep the best by reward")


def check_environment(job: JobBase) -> Iterator[tuple[Loc, str]]:
    """`generation.environment.path` imports and names an Environment class its options can build."""
    from rlhf_ray.functions import load_function
    from rlhf_ray.envs.environment import Environment

    env = getattr(getattr(job, "generation", None), "environment", None)
    if env is None:
        return
    loc = ("generation", "environment", "path")
    try:
        cls = load_function(env.path)
    except Exception as exc:  # the module's own import may raise anything
        yield loc, f"{exc}; check the spelling and that the module is importable from the job's working dir"
        return
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        yield loc, f"{env.path} is not a subclass of rlhf_ray.envs.environment.Environment"
        return
    try:
        cls(**env.options)
    except Exception as exc:  # noqa: BLE001 - whatever the constructor raises is the user's to see
        yield ("generation", "environment", "options"), f"{env.path}(**options) raised {exc!r}"


# --- models -----------------------------------------------------------------------------------------------------


def model_specs(node: BaseModel, loc: Loc = ()) -> Iterator[tuple[Loc, ModelSpec]]:
    """Every ModelSpec inside a job config, with its field path."""
    if isinstance(node, ModelSpec):
        yield loc, node
        return
    for name in type(node).model_fields:
        value = getattr(node, name)
        if isinstance(value, BaseModel):
            yield from model_specs(value, loc + (name,))


def check_model_folders(job: JobBase, produced: set[str]) -> Iterator[tuple[Loc, str]]:
    """Local model folders hold a readable config, whole safetensors files and a tokenizer that loads; a path
    that is neither a folder here nor a hub id is said to be missing. Folders an earlier pipeline stage writes
    are skipped."""
    seen: set[tuple[str, str]] = set()
    for loc, spec in model_specs(job):
        if spec.gguf_file is not None:
            continue  # checked with the GGUF file (check_engines)
        for field, path, what in (("path", spec.path, "model"), ("tokenizer", spec.tokenizer, "tokenizer")):
            if path is None or _norm(Path(path)) in produced or (field, path) in seen:
                continue
            seen.add((field, path))
            if not Path(path).exists():
                problem = _missing_problem(path, what)
            elif (problem := _local_problem(path, what)) is None:
                if what == "model":
                    problem = _weights_problem(Path(path), spec.allow_pickle_weights)
                if problem is None and (what == "tokenizer" or spec.tokenizer is None):
                    problem = _tokenizer_problem(Path(path), spec.trust_remote_code)
            if problem:
                yield loc + (field,), problem


def _norm(path: Path) -> str:
    return os.path.normpath(os.path.abspath(path))


def _local_problem(path: str, what: str) -> str | None:
    folder = Path(path)
    if not folder.is_dir():
        return f"{path} is a file; a {what} is a Hugging Face folder (config.json, weights, tokenizer files)"
    if what == "model":
        config = folder / "config.json"
        if not config.is_file():
            return f"{config} is missing: {path} is not a Hugging Face model folder; point at the folder that holds it"
        try:
            json.loads(config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            return f"{config} is unreadable ({exc}); restore the file from the model's source"
    return None


def _missing_problem(path: str, what: str) -> str | None:
    """A path that does not exist here: fine if it is a hub id (fetched later), else missing."""
    from huggingface_hub import constants

    if looks_local(path, Path.cwd()):
        return (f"no such folder {path!r}; fix the path (a relative one is taken from the working directory), or "
                f"build the {what} first")
    if constants.HF_HUB_OFFLINE:
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(path, "config.json" if what == "model" else "tokenizer_config.json"),
                          str):
            return (f"{path!r} is not a local folder and not in the hub cache, and HF_HUB_OFFLINE is set; download "
                    f"it (`hf download {path}`) or unset HF_HUB_OFFLINE")
    return None


def _weights_problem(folder: Path, allow_pickle: bool = False) -> str | None:
    """Every safetensors file's header parses and its tensors lie inside the file (a cut-off download fails);
    pickled weights only when allowed."""
    index = folder / "model.safetensors.index.json"
    files = sorted(folder.glob("*.safetensors"))
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            return f"{index} is unreadable ({exc}); restore it from the model's source"
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            return f"{index} names shards that are missing: {', '.join(missing[:3])}; download them again"
    pickled = any(folder.glob("*.bin")) or any(folder.glob("*.pt"))
    if not files and not pickled:
        return f"{folder} holds no weights (*.safetensors); point at a complete model folder"
    if not files and not allow_pickle:
        return (f"{folder} holds pickled weights only (*.bin / *.pt), which can run code when loaded; convert them "
                "to safetensors (save_pretrained does), or set allow_pickle_weights: true on this model if you "
                "trust the file")
    for file in files:
        problem = safetensors_problem(file)
        if problem:
            return f"{file}: {problem}; the file is damaged or incomplete: download or save it again"
    return None


def safetensors_problem(file: Path) -> str | None:
    """Read only the header: 8-byte length, JSON, and tensor offsets within the file's size."""
    size = file.stat().st_size
    try:
        with file.open("rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                return f"only {size} bytes, shorter than a safetensors header"
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                return f"header announces {length} bytes but the file has {size - 8} after it"
            header = json.loads(handle.read(length).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"unreadable safetensors header ({exc})"
    if not isinstance(header, dict):
        return "unreadable safetensors header (not a JSON object)"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
               and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2), default=0)
    if 8 + length + end > size:
        return f"truncated: its tensors need {8 + length + end} bytes, the file has {size}"
    return None


def _tokenizer_problem(folder: Path, trust_remote_code: bool) -> str | None:
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises OSError, ValueError, JSONDecodeError, ... for a bad folder
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return (f"cannot load the tokenizer in the local folder {folder} ({type(exc).__name__}: {text[:300]}); "
                "restore its tokenizer files or set the tokenizer field to one that loads")
    return None


# --- engines and GGUF files (checks that used to live in the CLI) ------------------------------------------------


def check_engines(job: JobBase, source: ConfigSource, files: bool = True) -> list[str]:
    """A GGUF file that is missing or corrupt, a model whose architecture the chosen engine cannot serve, a reward
    model whose tokenizer cannot be bridged."""
    from rlhf_ray.models.sources import ModelSourceError, check_gguf, gguf_path, gguf_specs
    from rlhf_ray.models.support import model_problems

    problems = []
    for where, spec in gguf_specs(job) if files else []:
        loc = tuple(where.split(".")) + ("gguf_file",)
        try:
            check_gguf(gguf_path(spec.path, spec.gguf_file))
        except ModelSourceError as exc:
            problems.append(f"{source.where(loc)}: {'.'.join(loc)}: {exc}")
    for prefix, stage_job in stages(job):
        for field, problem in model_problems(stage_job):
            loc = prefix + tuple(field.split("."))
            problems.append(f"{source.where(loc)}: {'.'.join(loc)}: {problem}")
    return problems


# ---- the plan against the cluster ----------------------------------------------------------------------------
def _cluster_nodes(job: JobBase, live: bool) -> tuple[list[dict[str, float]], str]:
    """Nodes to check the plan against, and a phrase saying which cluster that is."""
    from rlhf_ray import cluster

    spec = job.cluster
    if spec.shape is not None and not live:
        return nodes_from_shape(spec.shape), "the cluster shape declared in cluster.shape"
    if spec.address or os.environ.get("RAY_ADDRESS"):
        with cluster.connect(spec) as handle:
            return handle.nodes(), f"the live Ray cluster at {spec.address or os.environ['RAY_ADDRESS']}"
    return cluster.local_nodes(spec), "this machine (an embedded local Ray)"


def check_plan(job: JobBase, live: bool = False, show: bool = True) -> list[str]:
    """Every stage's resource plan against the cluster it would run on; problems prefixed by stage."""
    out = Console(soft_wrap=True)
    nodes, which = _cluster_nodes(job, live)
    problems: list[str] = []
    if which.startswith("this machine"):
        from rlhf_ray.cluster import missing_local_gpus

        if missing := missing_local_gpus(job.cluster):
            problems.append(f"{job.where(('cluster', 'num_gpus'))}: {missing}")
    derived: dict = {}  # shapes of the models earlier stages write
    for name, stage_job in job.named_stages().items():
        stage = name or stage_job.kind
        plan = ResourcePlan.from_roles(stage_job.placement_roles())
        if show:
            out.print(plan.render(title=f"{stage}: resource plan"))
        problems += [f"{stage}: {p}" for p in plan.check_fits(nodes)]
        memory, too_big = check_memory(stage_job, plan, nodes, derived, stage)
        derived.update(written_shapes(stage_job, derived))
        if show:
            out.print(memory)
        problems += [f"{stage}: {p}" for p in too_big]
    if show:
        out.print(f"checked against {which}: {describe_nodes(nodes)}")
    return problems


# ---- on each node the job was placed on ----------------------------------------------------------------------
def node_inputs(job: JobBase) -> dict[str, list[tuple[Loc, str]]]:
    """Role -> (field, absolute path) of every local file or folder that role's actors read on their own node:
    model and tokenizer folders (generation engines load the policy's), mmap corpora. Hub ids are not files."""
    reads: dict[str, list[tuple[Loc, str]]] = {}

    def add(role: str, loc: Loc, path: str | None) -> None:
        if path and os.path.isabs(path):
            reads.setdefault(role, []).append((loc, path))

    for loc, spec in model_specs(job):
        roles = [loc[-2] if len(loc) >= 2 else "learner"]
        if loc == ("policy", "model"):
            roles.append("generation")
        if loc == ("model",) and getattr(job, "dpo", None) is not None and not job.dpo.reference.model.is_set:
            roles.append("reference")  # the DPO reference starts from the trained model
        for role in roles:
            add(role, loc + ("path",), spec.path)
            add(role, loc + ("tokenizer",), spec.tokenizer)
    for i, prefix in enumerate(getattr(getattr(job, "ppo", None), "pretrain_data", None) or []):
        for suffix in (".bin", ".idx"):
            add("policy", ("ppo", "pretrain_data", str(i)), prefix + suffix)
    for i, corpus in enumerate(getattr(getattr(job, "data", None), "corpora", None) or []):
        for suffix in (".bin", ".idx"):
            add("learner", ("data", "corpora", str(i), "path"), corpus.path + suffix)
    return reads


def check_on_nodes(job: JobBase, plan: ResourcePlan, placements: dict, timeout_s: float) -> None:
    """On a cluster of more than one node, after the job's placement groups are ready and before any actor starts:
    each role's inputs (node_inputs) are checked on every node its replicas were placed on, and the output_dir
    from every node that hosts the job (each actor writes its log there, learners their checkpoints). A path that
    passed on the driver's host can be missing on another; a folder that is local to each host is a different
    folder on each. Raises ConfigError naming the node, the field and its line, and the fix."""
    import ray

    from rlhf_ray import cluster

    if sum(1 for n in ray.nodes() if n.get("Alive")) < 2:
        return
    inputs = node_inputs(job)
    role_nodes = {role: cluster.nodes_of(placements[slot.placement], list(range(slot.replicas)))
                  for role, slot in plan.slots.items()}
    asks: dict[str, list[str]] = {}
    for role, nodes in role_nodes.items():
        for node in nodes:
            asks.setdefault(node, [])
            asks[node] += [path for _, path in inputs.get(role, []) if path not in asks[node]]
    found = cluster.check_paths_on_nodes(asks, job.output_dir, timeout_s)
    problems = []
    for node, seen in found.items():
        address = cluster.node_address(node)
        for role, nodes in role_nodes.items():
            for loc, path in inputs.get(role, []) if node in nodes else []:
                if path in seen.unreadable:
                    problems.append(f"{job.where(loc)}: {path} is missing or unreadable on node {address}, where "
                                    f"the {role} role was placed (the driver's host has it); put it on storage every "
                                    "node mounts at the same path, or copy it to that path on every node")
        if not seen.same_folder:
            problems.append(f"{job.where(('output_dir',))}: {job.output_dir} on node {address} is not the folder "
                            "the driver writes to (a file written there by the driver is not seen on that node), "
                            "and the job's actors there write into it (logs, checkpoints, models): set output_dir "
                            "to shared storage every node mounts at the same path (NFS, a KubeRay volume)")
        elif not seen.writable:
            problems.append(f"{job.where(('output_dir',))}: {job.output_dir} is not writable on node {address} "
                            "by the user its Ray node runs as; give that user write access")
    if problems:
        raise ConfigError(problems)
