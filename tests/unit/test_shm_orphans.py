"""Orphaned shared memory (issue 41): a job's files on a machine are held (a shared flock) by
every process that uses them; files whose lock no live process holds are swept by the next
job, whatever launched either, and a live job's files never are (byteps_like/shm_names.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from byteps_like import local, shm_names

HOLDER = """
import sys, time
from byteps_like import shm_names
fd = shm_names.hold(sys.argv[1], sys.argv[2])
open(sys.argv[1] + "/" + sys.argv[2] + "t0", "w").close()
print("held", flush=True)
sys.stdin.read()   # until the test closes stdin (or kills it)
"""


def _holder(shm_dir, prefix) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(shm_dir), prefix],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_live_jobs_files_stay_and_a_killed_jobs_files_go(tmp_path):
    live, dead = "bpsl-torchrun-a-29500-m0-", "bpsl-torchrun-b-29501-m0-"
    a, b = _holder(tmp_path, live), _holder(tmp_path, dead)
    try:
        for name in ("t1", "t2", "peers"):
            (tmp_path / (dead + name)).write_bytes(b"x" * 100)
        (tmp_path / (live + "t1")).write_bytes(b"y")
        # a job whose id extends the dead one's: its files are not the dead job's
        (tmp_path / (dead + "9-m0-t1")).write_bytes(b"z")
        assert shm_names.sweep_orphans(str(tmp_path)) == []   # both alive
        b.send_signal(signal.SIGKILL)
        b.wait(10)
        removed = shm_names.sweep_orphans(str(tmp_path))
        assert sorted(removed) == sorted(dead + n for n in ("t0", "t1", "t2", "peers", "lock"))
        assert sorted(os.listdir(tmp_path)) == sorted(
            [live + "lock", live + "t0", live + "t1", dead + "9-m0-t1"])
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
            p.wait(10)
            p.stdin.close()
            p.stdout.close()
    # a's process is gone too: its files are an orphan's now
    assert sorted(shm_names.sweep_orphans(str(tmp_path))) == sorted(
        [live + "lock", live + "t0", live + "t1"])


def test_the_last_process_to_let_go_removes_the_jobs_files(tmp_path):
    prefix = "bpsl-job-1-m0-"
    other = _holder(tmp_path, prefix)
    try:
        local.hold(prefix, str(tmp_path))
        (tmp_path / (prefix + "t5")).write_bytes(b"x")
        local.release(prefix, str(tmp_path))        # another process still holds them
        assert (tmp_path / (prefix + "t5")).exists()
        local.hold(prefix, str(tmp_path))
    finally:
        other.stdin.close()
        other.wait(10)
        other.stdout.close()
    local.release(prefix, str(tmp_path))            # the last one: everything goes
    assert os.listdir(tmp_path) == []


def test_the_first_hold_of_a_process_sweeps_orphans(tmp_path):
    orphan = "bpsl-local-1-2-ab-40000-m0-"
    (tmp_path / (orphan + "t1")).write_bytes(b"x" * 1000)
    dead = _holder(tmp_path, orphan)
    dead.kill()
    dead.wait(10)
    dead.stdin.close()
    dead.stdout.close()
    code = (f"from byteps_like import local; local.hold('bpsl-new-1-m0-', {str(tmp_path)!r}); "
            f"import os; print(sorted(os.listdir({str(tmp_path)!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "['bpsl-new-1-m0-lock']", out
    assert os.listdir(tmp_path) == []   # and its own lock went at its exit
