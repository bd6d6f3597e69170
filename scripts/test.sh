#!/usr/bin/env bash
# Sets up .venv from the project's own files and runs lint, types and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# editable_mode=compat puts the checkout on sys.path through a .pth file, so PySpark's
# lookup of top-level pyspark_* modules finds pyspark_keygate (an import hook would hide it).
# The console's browser test drives Debian's Chromium and chromedriver: install them where
# they are missing (CI runs as root); elsewhere that one test skips and says why.
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
    else
        echo "note: Chromium is not installed: the console's browser test will skip" >&2
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
