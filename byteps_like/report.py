"""The periodic REPORT a node sends the scheduler (``BYTEPS_REPORT_INTERVAL_SECONDS``): a
worker's progress and exchange time (worker/telemetry.py), a server's traffic, keys, CPU and
straggler report (server/core.py). The scheduler keeps them for the live page, the straggler
line and its metrics (scheduler/reports.py). A small JSON meta on the control connection,
about one a second per node: nothing on the data plane."""
from __future__ import annotations

from typing import Any

from .control import SCHEDULER
from .wire import Header, MsgType, encode


def send_report(control: Any, meta: dict) -> bool:
    """Send ``meta`` as this node's REPORT through its ControlClient; False (nothing sent)
    before the node table or once the job is ending."""
    if control is None or control.rank < 0 or control.fatal is not None \
            or control.shutting_down:
        return False
    hdr = Header(MsgType.REPORT, role=control.role, rank=control.rank, job=control.job)
    control.ep.send(SCHEDULER, encode(hdr, meta=meta))
    return True
