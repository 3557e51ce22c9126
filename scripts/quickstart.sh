#!/usr/bin/env bash
# Sets up the environment (reused when unchanged) and runs the quickstart on CPU: GRPO on SmolLM2-135M-Instruct
# (configs/quickstart/grpo.yaml), or with --pipeline the tiny SFT -> RM -> PPO pipeline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/rlhf-ray quickstart "$@"
