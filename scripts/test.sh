#!/usr/bin/env bash
# Sets up .venv from the project's own files and runs lint, types and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# editable_mode=compat puts the checkout on sys.path through a .pth file, so PySpark's
# lookup of top-level pyspark_* modules finds pyspark_keygate (an import hook would hide it).
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet --config-settings editable_mode=compat -e '.[test,fast]'
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# pytest exits 5 when it collects nothing: that is a failure here, not a pass.
.venv/bin/pytest "$@"
