"""Where a model comes from, turned into a plain HF folder every role can load (DeepSpeed learners, the hf engine
and vLLM all read safetensors folders):

- a hub id or a local HF folder: used as it is;
- a GGUF file (`model.gguf_file`): dequantised by transformers (with the `gguf` package) and written once as a
  safetensors folder under `<output_dir>/models/` (or $RLHF_RAY_MODELS_DIR), keyed by the file's content,
  before any actor starts;
- a model a package ships (`model.gguf_file: package:smollm2`, `package:gemma3`): see models/packaged.py.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
from pathlib import Path

from rlhf_ray.models.gguf_header import GGUFHeaderError, read_gguf_header
from rlhf_ray.models.gguf_tokens import (apply_to_tokenizer, disagreements, generation_config,
                                         read_gguf_tokens, write_tokenizer_flags)
from rlhf_ray.models.packaged import MODELS_DIR_ENV, PACKAGE_PREFIX, PackagedModelError, packaged_gguf
from rlhf_ray.models.tiny import write_model_folder

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"


class ModelSourceError(ValueError):
    """A model source that cannot be used; the message names the file or architecture and what to do."""


def check_gguf(path: str | Path) -> dict:
    """Read a GGUF file's header (models/gguf_header.py: no metadata values, no tensors): its architecture and size.
    A missing file, another format or a truncated file is a ModelSourceError naming it."""
    file = Path(path)
    if not file.is_file():
        raise ModelSourceError(f"GGUF file {file} does not exist")
    with file.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelSourceError(f"{file} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        header = read_gguf_header(file)
    except (GGUFHeaderError, OSError) as exc:
        raise ModelSourceError(f"GGUF file {file} cannot be read ({exc}); it is corrupt or truncated") from exc
    arch, tensors = header.architecture, header.tensors
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ModelSourceError(f"GGUF file {file} holds a {arch!r} model, which transformers cannot dequantise "
                               f"(it reads: {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}); convert it to an "
                               f"HF folder another way and set model.path")
    return {"architecture": arch, "tensors": tensors, "bytes": file.stat().st_size}


def _content_key(file: Path) -> str:
    """Size plus a hash of the first and last MiB: cheap, and different for any other file seen in practice."""
    digest = hashlib.sha256(str(file.stat().st_size).encode())
    with file.open("rb") as f:
        digest.update(f.read(2**20))
        f.seek(max(0, file.stat().st_size - 2**20))
        digest.update(f.read())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _gguf_bar_as_transformers_bars():
    """transformers' GGUF conversion draws its progress bar with plain tqdm, which its disable_progress_bar() does
    not reach: off too while transformers' own bars are (a quiet job, cli.quiet_libraries)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None or hf_logging.is_progress_bar_enabled():
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses a GGUF file anew for the tokenizer, the config and the model (and for the model's config
    once more), and read_gguf_tokens a fifth time: each parse turns every metadata value into numpy views (SmolLM2's
    ~100k vocabulary and merge strings), and it maps tensor names per submodule, building gguf's name table for
    each: together over half of an import (tests/test_gguf_import.py). Inside this block a file is parsed once and
    a name table built once per architecture; both only read (the reader is a read-only memory map)."""
    import gguf

    make_reader, make_names = gguf.GGUFReader, gguf.get_tensor_name_map

    @functools.lru_cache(maxsize=None)
    def reader(path: str, mode: str = "r"):
        return make_reader(path, mode)

    gguf.GGUFReader = lambda path, mode="r": reader(str(Path(path).resolve()), mode)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(make_names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, make_names


def import_gguf(gguf_file: str | Path, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Dequantise a GGUF model into a plain HF folder (fp32 safetensors, tokenizer, generation config). The GGUF's
    special-token metadata is kept (add BOS / EOS, every stop id, named chat templates: models/gguf_tokens.py), so
    plain transformers loads the folder with the behaviour the file describes. Written in a temporary folder beside
    `out_dir` and renamed into place, so a crash never leaves half a model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    file = Path(gguf_file).resolve()
    info = check_gguf(file)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} is not empty; pass overwrite=True (--overwrite) to replace it")
    folder, name = str(file.parent), file.name
    log.info("importing %s (%s, %d tensors, %.0f MB)", file, info["architecture"], info["tensors"],
             info["bytes"] / 1e6)
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        with _gguf_bar_as_transformers_bars():
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        # a GGUF-loaded model refuses save_pretrained: rebuild it from its config without the quantisation record
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        special = read_gguf_tokens(file)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    # transformers drops the GGUF's add-BOS / add-EOS flags, end-of-turn ids and named templates: carry them over
    apply_to_tokenizer(tokenizer, special)
    if problems := disagreements(tokenizer, special):
        raise ModelSourceError(f"{file}: the converted tokenizer does not behave as the GGUF's metadata says: "
                               f"{'; '.join(problems)}")
    model.generation_config = generation_config(special, tokenizer)
    return write_model_folder(model, tokenizer, out, finish=lambda folder: write_tokenizer_flags(folder, special))


def gguf_path(path: str | None, gguf_file: str) -> Path:
    """`gguf_file` as given, relative to `path` when that is set (transformers' convention); `package:NAME` is the
    GGUF file a package ships (models/packaged.py)."""
    if gguf_file.startswith(PACKAGE_PREFIX):
        try:
            return packaged_gguf(gguf_file.removeprefix(PACKAGE_PREFIX))
        except PackagedModelError as exc:
            raise ModelSourceError(str(exc)) from None
    return Path(path) / gguf_file if path else Path(gguf_file)


def materialize_gguf(path: str | None, gguf_file: str, models_dir: str | Path) -> Path:
    """The HF folder of a GGUF source under `models_dir`, imported on first use and reused after (keyed by the
    file's name and content)."""
    file = gguf_path(path, gguf_file)
    check_gguf(file)
    out = imported_folder(file, models_dir)
    if (out / "config.json").is_file():
        return out
    return import_gguf(file, out, overwrite=True)


def imported_folder(file: Path, models_dir: str | Path) -> Path:
    """Where materialize_gguf keeps the import of a GGUF file under `models_dir` (by its name and content)."""
    return Path(models_dir) / f"{file.stem}-{_content_key(file)}"


def gguf_specs(config) -> list[tuple[str, object]]:
    """(dotted field, ModelSpec) of every model in a job config that names a GGUF file."""
    from pydantic import BaseModel

    from rlhf_ray.config.model import ModelSpec

    found: list[tuple[str, object]] = []

    def walk(node, where: str) -> None:
        if isinstance(node, ModelSpec):
            if node.gguf_file is not None:
                found.append((where, node))
            return
        if isinstance(node, BaseModel):
            for name in type(node).model_fields:
                walk(getattr(node, name), f"{where}.{name}" if where else name)

    walk(config, "")
    return found


def check_model_sources(job) -> None:
    """Every GGUF file a job names exists and parses; a ModelSourceError names the field and the file. Cheap
    (headers only): `rlhf-ray validate` and every job call it before anything starts."""
    for where, spec in gguf_specs(job):
        try:
            check_gguf(gguf_path(spec.path, spec.gguf_file))
        except ModelSourceError as exc:
            raise ModelSourceError(f"{where}.gguf_file: {exc}") from None


def imported_models_dir(output_dir: str | Path) -> Path:
    """Where a job's GGUF imports go: $RLHF_RAY_MODELS_DIR when set, else `<output_dir>/models`."""
    return Path(os.environ.get(MODELS_DIR_ENV) or Path(output_dir) / "models")


def resolve_model_sources(job):
    """The job with every GGUF model replaced by its imported HF folder (see imported_models_dir)."""
    specs = gguf_specs(job)
    if not specs:
        return job
    check_model_sources(job)
    job = job.model_copy(deep=True)
    models_dir = imported_models_dir(job.output_dir)
    for where, _ in specs:
        *parents, last = where.split(".")
        owner = job
        for name in parents:
            owner = getattr(owner, name)
        spec = getattr(owner, last)
        folder = str(materialize_gguf(spec.path, spec.gguf_file, models_dir))
        tokenizer = spec.tokenizer if spec.tokenizer and spec.tokenizer != spec.path else folder
        setattr(owner, last, spec.model_copy(update={"path": folder, "gguf_file": None, "tokenizer": tokenizer}))
        log.info("%s: GGUF %s served from %s", where, spec.gguf_file, folder)
    return job
