#!/usr/bin/env bash
# Sets up .venv from the project's own files and runs lint, types and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[test,fast]'
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# pytest exits 5 when it collects nothing: that is a failure here, not a pass.
.venv/bin/pytest "$@"
