"""Uneven emulated clusters (byteps_like/bench/links.py) for real, small: ``bench cluster``
with a straggler's NIC and a rate schedule that changes every cap twice mid-run, and
``Compression.auto`` deciding as the link changes. Skipped with the reason where network
namespaces cannot be built (not root, no iproute2), as tests/integration/test_cluster.py."""
from __future__ import annotations

import json
import re
import uuid

import pytest

from .test_cluster import _assert_clean, _finish, _root_links, _start, needs_netns

pytestmark = pytest.mark.integration


@needs_netns
def test_a_rate_schedule_with_a_straggler_and_auto_compression(tmp_path):
    out_json = tmp_path / "uneven.json"
    marker = f"uneven-{uuid.uuid4().hex}"
    before = _root_links()
    proc = _start(["--compressors", "auto", "--workers", "2", "--servers", "2", "--sizes", "4",
                   "--rate", "200mbit:3s,50mbit:4s,200mbit:3s", "--straggler", "1:2",
                   "--warmup", "1", "--link-seconds", "1", "--partition-bytes", "262144",
                   "--timeout", "120", "--json", str(out_json)], marker)
    out, err = _finish(proc, 300)
    assert proc.returncode == 0, out + err
    _assert_clean(proc.pid, marker, before)
    assert "teardown: clean" in out, out
    # the switches, once per run (none, then auto), at about 3 s and 7 s
    switches = re.findall(r"RATE SWITCH at ([\d.]+) s: every NIC -> ([\d.]+) Gbit/s", err)
    assert [r for _t, r in switches] == ["0.05", "0.2"] * 2, err
    assert all(2.9 <= float(t) <= 4.5 or 6.9 <= float(t) <= 8.5 for t, _r in switches), err
    recs = {r["compressor"]: r for r in json.loads(out_json.read_text())}
    for rec in recs.values():
        assert rec["schedule"] == "200mbit:3s,50mbit:4s,200mbit:3s"
        assert len(rec["switch_times"]) == 2 and len(rec["segment_median_seconds"]) == 3
    # uncompressed, the slow segment's rounds are the slowest
    none = recs["none"]["segment_median_seconds"]
    assert none[1] is not None and none[0] is not None and none[1] > 2 * none[0], none
    auto = recs["auto"]
    assert auto["auto_decisions"], err    # rank 0 decided (at least its first window)
    assert len(auto["auto_redecide_seconds"]) == 2
    assert "[schedule] auto: switch to 50 Mbit/s at" in out, out
    assert "[schedule] auto: switch to 200 Mbit/s at" in out, out
