"""The emulated-cluster benchmark (``python -m byteps_like.bench cluster``), small and fast:
2 worker hosts + 1 server host in network namespaces, 16 MiB, a generous NIC cap.

It checks correctness (every worker verifies its sums; the run must exit 0 and write its
records) and clean teardown (no namespace, link or process left, also after SIGINT/SIGTERM),
never speed. Skipped with the reason where network namespaces cannot be built (not root, no
iproute2, a sandbox without CAP_NET_ADMIN).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from byteps_like.bench import netns
from tests.support import watch

pytestmark = pytest.mark.integration

_WHY = netns.why_unavailable() if sys.platform == "linux" else "needs Linux"
needs_netns = pytest.mark.skipif(_WHY is not None, reason=str(_WHY))


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()
            if line.count(":") >= 2}


def _procs_with_marker(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _start(args: list[str], marker: str) -> subprocess.Popen:
    env = {**os.environ, "BPSL_TEST_MARKER": marker}
    return subprocess.Popen([sys.executable, "-m", "byteps_like.bench", "cluster", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """Its output; on a hang SIGTERM its group (the benchmark then tears its namespaces
    down), SIGKILL after 20 s, and fail (tests/support.py's watchdog)."""
    _, out, err = watch(proc, timeout, "the cluster benchmark", first=signal.SIGTERM, grace=20)
    return out, err


def _assert_clean(pid: int, marker: str, links_before: set[str]) -> None:
    deadline = time.monotonic() + 10
    while True:
        ns_left = [n for n in netns.list_namespaces() if n.startswith(f"bpsl-{pid}-")]
        procs = _procs_with_marker(marker)
        etc = os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else []
        ns_left += [f"/etc/netns/{d}" for d in etc if d.startswith(f"bpsl-{pid}-")]
        if not ns_left and not procs:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"left behind: namespaces {ns_left}, processes {procs}")
        time.sleep(0.2)
    assert _root_links() == links_before, "the root namespace's links changed"


@needs_netns
def test_small_cluster_is_correct_and_tears_down(tmp_path):
    marker = uuid.uuid4().hex
    links = _root_links()
    out_json, plot = tmp_path / "c.json", tmp_path / "c.png"
    proc = _start(["--workers", "2", "--servers", "1", "--sizes", "16", "--rate", "10gbit",
                   "--repeats", "1", "--warmup", "0", "--skip-horovod", "--skip-priority",
                   "--link-seconds", "1", "--json", str(out_json), "--plot", str(plot)], marker)
    out, err = _finish(proc, 240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    assert "teardown: clean" in out
    records = json.loads(out_json.read_text())
    systems = {r["system"] for r in records}
    assert {"byteps_like", "gloo", "theory"} <= systems
    for r in records:
        assert {"system", "n", "k", "bytes", "seconds", "link_bits_per_second"} <= set(r)
        assert r["bytes"] == 16 << 20 and r["seconds"] > 0 and r["link_bits_per_second"] > 0
    bps = [r for r in records if r["system"] == "byteps_like"]
    assert [(r["n"], r["k"]) for r in bps] == [(2, 1)]
    _assert_clean(proc.pid, marker, links)


@needs_netns
def test_compression_mode_reports_wire_bytes(tmp_path):
    marker = uuid.uuid4().hex
    links = _root_links()
    out_json = tmp_path / "c.json"
    proc = _start(["--compressors", "topk", "--sizes", "4", "--rate", "10gbit", "--repeats",
                   "1", "--warmup", "0", "--link-seconds", "1", "--json", str(out_json)], marker)
    out, err = _finish(proc, 120)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    assert "teardown: clean" in out and "topk k=0.01 +EF" in out
    assert "[cluster] compression n=2 k=2: topk k=0.01 +EF (2/2)" in err
    records = json.loads(out_json.read_text())
    assert [r["compressor"] for r in records] == ["none", "topk"]       # baseline first
    none, topk = records
    for r in records:
        assert r["system"] == "byteps_like_compressed" and (r["n"], r["k"]) == (2, 2)
        assert r["bytes"] == 4 << 20 and r["seconds"] > 0 and r["link_bits_per_second"] > 0
    # uncompressed: every byte of the model goes out and comes back
    assert none["bytes_pushed_per_step"] == none["bytes_pulled_per_step"] == 4 << 20
    assert none["bytes_ratio"] == 1.0 and none["time_ratio"] == 1.0
    assert 0 < topk["bytes_ratio"] < 0.2    # 1% of the elements; small tensors go as they are
    _assert_clean(proc.pid, marker, links)


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_run_removes_everything(sig):
    marker = uuid.uuid4().hex
    links = _root_links()
    proc = _start(["--workers", "2", "--servers", "1", "--sizes", "16", "--rate", "200mbit",
                   "--repeats", "50", "--skip-horovod", "--skip-priority", "--skip-gloo",
                   "--link-seconds", "1", "--plot", ""], marker)
    # wait until the job's processes run inside the namespaces, then interrupt the driver
    deadline = time.monotonic() + 60
    while len(_procs_with_marker(marker)) < 5:
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = _finish(proc, 10)
            pytest.fail(f"the job never started\n{out}\n{err}")
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(sig)
    out, err = _finish(proc, 60)
    assert proc.returncode != 0
    _assert_clean(proc.pid, marker, links)


@needs_netns
def test_sweep_removes_a_dead_runs_namespaces():
    dead = subprocess.Popen(["true"])
    dead.wait()                           # a pid that no longer runs
    name = f"bpsl-{dead.pid}-w0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in netns.sweep()
        assert name not in netns.list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_cluster_needs_root_or_says_why(monkeypatch, capsys):
    from byteps_like.bench import cluster
    monkeypatch.setattr(netns, "why_unavailable", lambda: "the emulated cluster needs root")
    assert cluster.main(["--quick"]) == 2
    assert "needs root" in capsys.readouterr().err


def test_theory_formulas():
    from byteps_like.bench.cluster import allreduce_time, ps_time
    S, B = 64 << 20, 1e9
    assert ps_time(4, 4, S, B) == pytest.approx(S * 8 / B)              # k = n: S/B
    assert ps_time(4, 0, S, B) == pytest.approx(allreduce_time(4, S, B))  # colocated = ring
    assert allreduce_time(4, S, B) / ps_time(4, 4, S, B) == pytest.approx(1.5)
    assert ps_time(2, 1, S, B) == pytest.approx(S * 8 / B)


def test_model_tensors_sum_exactly():
    from byteps_like.bench.vgg16 import model_tensors
    for mib in (16, 64, 256):
        specs = model_tensors(mib << 20)
        assert sum(c for _n, c, _l in specs) * 4 == mib << 20
        assert len(specs) == 32 and min(c for _n, c, _l in specs) >= 1
