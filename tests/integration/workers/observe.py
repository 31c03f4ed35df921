"""Observability worker: a known run of push_pulls (tests/integration/test_observability.py).

argv: STEPS [SLEEP]. Each step push_pulls grad.a (1000 float32, one partition) and grad.b
(300000 float32, several partitions with a small BYTEPS_PARTITION_BYTES). With OBSERVE_SCRAPE=1
the worker scrapes its own Prometheus endpoint before and after the steps."""
import os
import sys
import time
import urllib.request

import numpy as np

import byteps_like as bps
from byteps_like.worker.runtime import default_runtime


def scrape() -> dict:
    port = default_runtime().telemetry.metrics.port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


steps = int(sys.argv[1]) if len(sys.argv) > 1 else 6
sleep = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
bps.init()
check = os.environ.get("OBSERVE_SCRAPE") == "1"
if check:
    before = scrape()
a = np.ones(1000, np.float32)
b = np.ones(300_000, np.float32)
for _step in range(steps):
    ha = bps.push_pull_async(a, name="grad.a", priority=1)
    hb = bps.push_pull_async(b, name="grad.b", priority=0)
    ha.wait()
    hb.wait()
    if sleep:
        time.sleep(sleep)
ts, speed = bps.get_pushpull_speed()
print(f"SPEED rank {bps.rank()} {ts} {speed:.3f}", flush=True)
if check:
    after = scrape()
    r = bps.rank()
    lbl = f'{{rank="{r}",role="worker"}}'
    for name in ("byteps_bytes_pushed_total", "byteps_bytes_pulled_total", "byteps_rounds_total"):
        print(f"METRIC {name} {before[name + lbl]:.0f} {after[name + lbl]:.0f}", flush=True)
    push = f'byteps_stage_seconds_count{{rank="{r}",role="worker",stage="push"}}'
    print(f"METRIC push_count {before.get(push, 0):.0f} {after[push]:.0f}", flush=True)
bps.shutdown()
