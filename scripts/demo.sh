#!/usr/bin/env bash
# Sets up .venv from the project's own files and runs `keygate demo`: a real gateway on a
# temporary SQLite file and free ports, with traffic from every protocol, verified.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet --config-settings editable_mode=compat -e '.[demo,fast]'
exec .venv/bin/keygate demo "$@"
