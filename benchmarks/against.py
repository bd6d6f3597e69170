"""Run a benchmark on this checkout and on another revision at the same time.

    .venv/bin/python -m benchmarks.against 4f36f61 benchmarks.native_instructions --messages 4000
    .venv/bin/python -m benchmarks.against HEAD~1 benchmarks.instructions --messages 1000

The instruction benchmarks count the gateway's work, not the machine's speed, but how busy
the machine is still moves their counts a little (how publishes batch: up to 1 % between
invocations of the same code in process), so a change is measured against its baseline
running at the same time, under the same load. REVISION is checked out in a temporary git
worktree and given this checkout's ``benchmarks/``, so one harness measures both; the two
runs start together, and each one's output is printed under its name when both are done.
The exit status is the first non-zero one of the two runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run_both(revision: str, tree: Path, command: list[str]) -> dict[str, tuple[int, str]]:
    """(exit status, output) of ``command`` in this checkout and in ``tree``, run at once."""
    runs = {
        name: subprocess.Popen(
            [sys.executable, "-m", *command],
            cwd=path,
            env={**os.environ, "PYTHONPATH": str(path)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, path in ((f"this checkout ({ROOT})", ROOT), (revision, tree))
    }
    results = {}
    for name, run in runs.items():
        output = run.communicate()[0]
        results[name] = (run.returncode, output)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("revision", help="the git revision to compare with (e.g. HEAD~1)")
    parser.add_argument("module", help="the benchmark module (e.g. benchmarks.instructions)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's arguments")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "baseline"
        git = ["git", "-C", str(ROOT), "worktree"]
        added = subprocess.run(
            [*git, "add", "--detach", str(tree), args.revision], capture_output=True, text=True
        )
        if added.returncode != 0:
            raise SystemExit(f"cannot check out {args.revision}: {added.stderr.strip()}")
        try:
            shutil.copytree(
                ROOT / "benchmarks",
                tree / "benchmarks",
                dirs_exist_ok=True,
                ignore=shutil.ignore_patterns("__pycache__"),
            )
            results = _run_both(args.revision, tree, [args.module, *args.args])
        finally:
            subprocess.run([*git, "remove", "--force", str(tree)], capture_output=True)
    for name, (_, output) in results.items():
        print(f"== {name}\n{output}", end="" if output.endswith("\n") else "\n", flush=True)
    raise SystemExit(next((status for status, _ in results.values() if status), 0))


if __name__ == "__main__":
    main()
