#!/usr/bin/env bash
# Sets up the environment (reused when unchanged) and runs the whole test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests "$@"
