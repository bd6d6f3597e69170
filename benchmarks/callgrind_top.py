"""The functions that spent the instructions of one callgrind dump, by their own cost,
for the files ``benchmarks.native_instructions --keep DIR`` and
``benchmarks.mqtt_instructions --keep DIR`` leave (one file per phase; the phase is the
file's ``Trigger: dump`` line). ``callgrind_annotate`` 3.19 puts every instruction of
these files on ``_PyEval_Vector``; this reads each function's own cost (``fn=`` records,
without the inclusive cost of its calls) straight from the file.

    .venv/bin/python -m benchmarks.callgrind_top DIR/callgrind.out.2 --per 3000
    .venv/bin/python -m benchmarks.callgrind_top AFTER --base BEFORE --per 3000

``--per N``: divide by N (the messages of the phase). With ``--base``, the functions
whose cost grew most from BASE to the file come first. The interpreter's own functions
(``_PyEval_EvalFrameDefault`` and the object machinery) carry the Python code's cost;
which Python functions they ran for, callgrind cannot tell (cProfile or py-spy can).
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def self_costs(path: Path) -> Counter[str]:
    """Each function's own instructions in a callgrind file written with
    ``--compress-strings=no`` (names in full on every ``fn=`` line)."""
    costs: Counter[str] = Counter()
    function = None
    call_cost_next = False  # the line after ``calls=`` is the call's inclusive cost
    with path.open(errors="replace") as lines:
        for line in lines:
            if line.startswith("fn="):
                function = line[3:].strip()
            elif line.startswith("calls="):
                call_cost_next = True
            elif line[:1].isdigit() or line[:1] in "+-*":
                if call_cost_next:
                    call_cost_next = False
                elif function is not None:
                    fields = line.split()
                    if len(fields) >= 2:
                        costs[function] += int(fields[1])
    return costs


def report(costs: Counter[str], base: Counter[str] | None, per: float, top: int) -> list[str]:
    """The lines printed: the total, then the ``top`` functions."""
    lines = [f"{sum(costs.values()) / per:12,.0f}  in all"]
    if base is None:
        lines += [f"{cost / per:12,.0f}  {name}" for name, cost in costs.most_common(top)]
        return lines
    lines[0] += f" (base {sum(base.values()) / per:,.0f})"
    grown = sorted(set(costs) | set(base), key=lambda name: base[name] - costs[name])
    return lines + [
        f"{base[name] / per:12,.0f} → {costs[name] / per:12,.0f}  "
        f"{(costs[name] - base[name]) / per:+10,.0f}  {name}"
        for name in grown[:top]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--base", type=Path, help="a dump to compare with")
    parser.add_argument("--per", type=float, default=1.0, help="divide by (messages)")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    base = self_costs(args.base) if args.base else None
    print("\n".join(report(self_costs(args.file), base, args.per, args.top)))


if __name__ == "__main__":
    main()
