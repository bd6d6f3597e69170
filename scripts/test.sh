#!/usr/bin/env bash
# Sets up .venv from the project's own files and runs lint, types and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# editable_mode=compat puts the checkout on sys.path through a .pth file, so PySpark's
# lookup of top-level pyspark_* modules finds pyspark_keygate (an import hook would hide it).
# Debian packages some tests need, installed where they are missing (CI runs as root):
# Chromium and chromedriver for the console's browser test, docker-compose to check
# docker/compose.yaml (`config` needs no Docker engine). Elsewhere those tests skip and
# say why.
missing=()
command -v chromium >/dev/null && command -v chromedriver >/dev/null || missing+=(chromium chromium-driver)
command -v docker-compose >/dev/null || missing+=(docker-compose)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "note: ${missing[*]} not installed: the tests that need them will skip" >&2
    fi
fi
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet --config-settings editable_mode=compat -e '.[test,fast]'
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# pytest exits 5 when it collects nothing: that is a failure here, not a pass. The
# slowest tests are listed at the end, to keep the run short (on a slow machine it took
# 16 minutes, twice a fast one's).
.venv/bin/pytest --durations=15 "$@"
