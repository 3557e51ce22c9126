#!/usr/bin/env bash
# Sets up the environment (reused when unchanged) and runs the whole test suite on CPU (CI's command).
#   bash scripts/test.sh            every test (~30 min on 2 cores)
#   bash scripts/test.sh --fast     the tests that start no Ray: units of one piece each (a few minutes)
# Further arguments go to pytest (e.g. -k pattern, -x); a test file or folder first runs only that. The slowest tests are printed at the end of every run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Services the tests run for real, from the distribution's packages where this runs as root on Debian (CI):
# Chromium renders the report (tests/test_report.py), Prometheus scrapes a job for the Grafana dashboard's queries
# (tests/test_metrics_endpoint.py). Elsewhere a test whose service is not installed is skipped, saying so.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=()
  command -v chromium >/dev/null || missing+=(chromium)
  command -v prometheus >/dev/null || missing+=(prometheus)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "[test] installing ${missing[*]} (apt-get; output in .venv/apt.log)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      "${missing[@]}") > .venv/apt.log 2>&1 \
      || echo "[test] could not install ${missing[*]}: the tests that need them will be skipped (.venv/apt.log)"
  fi
fi
if [ "${1:-}" = "--fast" ]; then
  shift
  exec .venv/bin/python -m pytest tests -m "not system" "$@"
fi
if [ $# -gt 0 ] && [ -e "${1%%::*}" ]; then  # a test file or folder first: only what was named
  exec .venv/bin/python -m pytest "$@"
fi
exec .venv/bin/python -m pytest tests "$@"
