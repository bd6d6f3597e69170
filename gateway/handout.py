"""Handing one step's deliveries and partition changes to the flows' outputs
(``gateway.runtime.GroupRuntime``, step 3).

How it works. The machine's ``Deliver`` and ``PartitionsChanged`` actions go out in the
order it produced them; consecutive deliveries to one flow go in one ``FlowOutput.deliver``
call. What an output hands back (it cannot encode it) is reported as undeliverable. An
output that raises has a bug: it is logged, reported as broken and gets nothing more of
the step, while the other flows get theirs — one consumer's protocol never costs the
others their deliveries. The runtime then unbinds the broken flow, so what it holds is
redelivered rather than left in flight.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from core.actions import Deliver, PartitionsChanged
from protocols.sink import FlowOutput


@dataclass(slots=True)
class HandedOut:
    sent: list[Deliver] = field(default_factory=list)
    # flow id -> ids of the messages its output could not encode
    undeliverable: dict[str, list[str]] = field(default_factory=dict)
    # flow id -> its output, which raised
    broken: dict[str, FlowOutput] = field(default_factory=dict)


def hand_out(
    sends: Sequence[Deliver | PartitionsChanged],
    outputs: Mapping[str, FlowOutput],
    log: logging.LoggerAdapter[logging.Logger],
    group: str,
) -> HandedOut:
    """Give each flow's output its part of ``sends``, in order (see the module doc);
    ``group`` names the group in the log."""
    done = HandedOut()
    run: list[Deliver] = []
    for item in sends:
        if isinstance(item, Deliver) and (not run or run[-1].flow_id == item.flow_id):
            run.append(item)
            continue
        _deliver(run, outputs, done, log, group)
        run = []
        if isinstance(item, Deliver):
            run.append(item)
        elif (output := _usable(item.flow_id, outputs, done)) is not None:
            try:
                output.partitions_changed(item.partitions)
            except Exception:
                _broken(item.flow_id, output, done, log, group)
    _deliver(run, outputs, done, log, group)
    return done


def _usable(flow_id: str, outputs: Mapping[str, FlowOutput], done: HandedOut) -> FlowOutput | None:
    return None if flow_id in done.broken else outputs.get(flow_id)


def _deliver(
    run: list[Deliver],
    outputs: Mapping[str, FlowOutput],
    done: HandedOut,
    log: logging.LoggerAdapter[logging.Logger],
    group: str,
) -> None:
    if not run or (output := _usable(run[0].flow_id, outputs, done)) is None:
        return
    try:
        failed = output.deliver(run)
    except Exception:
        _broken(run[0].flow_id, output, done, log, group)
        return
    done.sent += [d for d in run if d not in failed] if failed else run
    if failed:
        ids = done.undeliverable.setdefault(run[0].flow_id, [])
        ids += [d.message.message_id for d in failed]


def _broken(
    flow_id: str,
    output: FlowOutput,
    done: HandedOut,
    log: logging.LoggerAdapter[logging.Logger],
    group: str,
) -> None:
    log.exception("group %s: the output of flow %s failed; unbinding it", group, flow_id)
    done.broken[flow_id] = output


__all__ = ["HandedOut", "hand_out"]
