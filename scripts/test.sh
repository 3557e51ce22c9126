#!/usr/bin/env bash
# Sets up the environment (reused when unchanged) and runs the whole test suite on CPU (CI's command).
#   bash scripts/test.sh            every test (~30 min on 2 cores)
#   bash scripts/test.sh --fast     the tests that start no Ray: units of one piece each (a few minutes)
# Further arguments go to pytest (e.g. -k pattern, -x). The slowest tests are printed at the end of every run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The report test renders the page in a real headless browser: in CI (root on Debian) Chromium comes from the
# distribution's packages; elsewhere that test is skipped when no Chromium is installed.
if [ -n "${CI:-}" ] && ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1 \
    || echo "could not install chromium: the report's browser test will be skipped"
fi
if [ "${1:-}" = "--fast" ]; then
  shift
  exec .venv/bin/python -m pytest tests -m "not system" "$@"
fi
exec .venv/bin/python -m pytest tests "$@"
