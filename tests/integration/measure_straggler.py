"""How soon the live page and ``bpslaunch status`` name a slow worker (issue 40), N runs with
tests/integration/test_dashboard.py's job: 3 workers and 2 servers, worker rank 1 sleeping
0.2 s a step, the others 0.02 s. One JSON line per run: seconds from the job forming to the
straggler event, the rank the page's JSON names, and bpslaunch status's STRAGGLER line.

    .venv/bin/python -m tests.integration.measure_straggler [--runs 3]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.integration.harness import WORKERS_DIR
from tests.integration.test_dashboard import Job, event


def once() -> dict:
    with tempfile.TemporaryDirectory(prefix="bpsl-straggler-") as tmp:
        job = Job(["--workers", "3", "--servers", "2", "--", sys.executable,
                   str(WORKERS_DIR / "straggler.py"), "170", "1", "0.2"], Path(tmp))
        try:
            s = job.wait_for(lambda s: event(s, "straggler") is not None, "the straggler")
            formed, named = event(s, "formed"), event(s, "straggler")
            status = subprocess.run([sys.executable, "-m", "byteps_like.launcher", "status",
                                     f"127.0.0.1:{job.port}"], capture_output=True, text=True,
                                    timeout=30).stdout
            line = next((ln for ln in status.splitlines() if ln.startswith("STRAGGLER")), "")
            rc = job.finish()
        finally:
            job.close()
    return {"named_after_forming_s": round(named["time"] - formed["time"], 1),
            "page_rank": (s.get("straggler") or {}).get("rank"), "status": line, "rc": rc}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    for _ in range(ap.parse_args().runs):
        print(json.dumps(once()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
