"""SLURM support: ``bpslaunch slurm``'s layout from SLURM's environment, and a real run: a
one-machine SLURM cluster (scripts/setup_slurm.sh: Debian's slurm-wlm, munged, slurmctld,
slurmd), two jobs submitted at once with ``sbatch scripts/sbatch_byteps_like.sh``, both exact.
The real run skips, with the reason, when SLURM cannot be installed or its daemons cannot start
here (not root, no apt, no munge, ...)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from byteps_like.launcher.cli import main as cli_main
from byteps_like.launcher.slurm import SlurmError, expand_hostlist, layout, node_specs

from .harness import FAST_ENV, WORKERS_DIR

REPO = Path(__file__).resolve().parents[2]
SETUP = REPO / "scripts" / "setup_slurm.sh"
SBATCH = REPO / "scripts" / "sbatch_byteps_like.sh"
STATE = Path("/tmp/bpsl-slurm")
SETUP_LIMIT_S = 150


# ------------------------------------------------------------------ layout (no SLURM needed)
@pytest.mark.parametrize("text,names", [
    ("n1", ["n1"]),
    ("node[01-03,7]", ["node01", "node02", "node03", "node7"]),
    ("a[1-2]-ib,b", ["a1-ib", "a2-ib", "b"]),
    ("r[1-2]n[8-9]", ["r1n8", "r1n9", "r2n8", "r2n9"]),
])
def test_expand_hostlist(text, names):
    assert expand_hostlist(text) == names


@pytest.mark.parametrize("text", ["n[1-2", "n1-2]", "n[a-b]"])
def test_bad_hostlist(text):
    with pytest.raises(SlurmError):
        expand_hostlist(text)


def _env(node: int, nodes="gpu[1-4]", n=4, **more):
    return {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": nodes, "SLURM_NNODES": str(n),
            "SLURM_NTASKS": str(n), "SLURM_NODEID": str(node), "SLURM_PROCID": str(node),
            **more}


def test_colocated_layout():
    lay, idx = layout(_env(0, SLURM_GPUS_ON_NODE="8"))
    assert idx == 0 and lay.scheduler_host == "gpu1" and lay.port == 10000 + 4242
    assert lay.env()["DMLC_NUM_WORKER"] == "4" and lay.env()["DMLC_NUM_SERVER"] == "4"
    assert lay.env()["BYTEPS_JOB_ID"] == "slurm-4242"
    assert lay.env()["BYTEPS_LOCAL_SIZE"] == "8"
    names = [s.name for s in node_specs(lay, 0, ["python", "t.py"])]
    assert names == ["scheduler", "server 0"] + [f"worker {r}" for r in range(8)]
    specs = node_specs(lay, 2, ["python", "t.py"])
    assert [s.name for s in specs][:2] == ["server 2", "worker 16"]
    w = specs[1].env
    assert (w["DMLC_WORKER_ID"], w["BYTEPS_LOCAL_RANK"], w["DMLC_NODE_HOST"]) == ("2", "0", "gpu3")
    assert w["DMLC_PS_ROOT_URI"] == "gpu1" and w["DMLC_ROLE"] == "worker"


def test_dedicated_server_nodes():
    lay, _ = layout(_env(3), server_nodes=1, servers=2, port=9999,)
    assert lay.worker_nodes == ("gpu1", "gpu2", "gpu3") and lay.server_hosts == ("gpu4",) * 2
    assert [s.name for s in node_specs(lay, 3, [])] == ["server 0", "server 1"]
    assert lay.port == 9999


@pytest.mark.parametrize("env,message", [
    ({}, "SLURM_JOB_NODELIST is not set"),
    (_env(0, n=4, SLURM_NTASKS="8"), "one task per node"),
    (_env(0, SLURM_NNODES="3"), "names 4 nodes"),
])
def test_layout_errors(env, message):
    with pytest.raises(SlurmError, match=message):
        layout(env)


def test_cli_outside_slurm(capsys):
    assert cli_main(["slurm", "--", "python", "t.py"], environ={}) == 2
    assert "inside a SLURM job step" in capsys.readouterr().err


# ------------------------------------------------------------------ the real thing
@pytest.fixture(scope="module")
def slurm_conf():
    if os.geteuid() != 0:
        pytest.skip("SLURM test needs root (to install slurm-wlm and run slurmd)")
    if shutil.which("bash") is None:
        pytest.skip("no bash to run scripts/setup_slurm.sh")
    try:
        r = subprocess.run(["bash", str(SETUP), str(STATE)], capture_output=True, text=True,
                           timeout=SETUP_LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.skip(f"scripts/setup_slurm.sh did not finish within {SETUP_LIMIT_S} s")
    if r.returncode != 0:
        reason = " | ".join(r.stderr.strip().splitlines()[-3:])
        pytest.skip(f"SLURM daemons cannot start here: {reason}")
    conf = r.stdout.strip().splitlines()[-1].partition("=")[2]
    started = "starting slurmctld" in r.stderr or "starting slurmd" in r.stderr
    yield conf
    if started:   # leave a cluster that was already running alone
        subprocess.run(["bash", str(SETUP), "--stop", str(STATE)], timeout=30)


@pytest.mark.integration
def test_two_sbatch_jobs(slurm_conf, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_",
                                                                     "SLURM_"))}
    env.update(FAST_ENV, SLURM_CONF=slurm_conf, BPSL_PYTHON=sys.executable,
               BPSL_SLURM_ARGS="--local-size 2 --timeout 150", PYTHONUNBUFFERED="1")
    procs = []
    for i in range(2):
        out = tmp_path / f"job{i}.out"
        cmd = ["sbatch", "--wait", "--nodes=1", f"--chdir={REPO}", f"--output={out}",
               f"--job-name=bpsl-test-{i}", str(SBATCH), sys.executable,
               str(WORKERS_DIR / "pushpull_check.py"), "1", "1000", "70001"]
        procs.append((out, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True)))
    results = []
    for out, p in procs:
        try:
            text, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
            subprocess.run(["scancel", "--name=bpsl-test-0", "--name=bpsl-test-1"],
                           env=env, timeout=30)
        log = out.read_text() if out.exists() else "(no job output)"
        results.append((p.returncode, text, log))
    job_ids = set()
    for rc, text, log in results:
        report = f"sbatch exit {rc}\n{text}\n--- job output ---\n{log}"
        assert rc == 0, report
        assert len(re.findall(r"OK rank \d of 2: 36 tensors checked", log)) == 2, report
        m = re.search(r"scheduler on \S+:(\d+).*BYTEPS_JOB_ID=(slurm-\d+)", log)
        assert m, report
        job_ids.add(m.groups())
    assert len(job_ids) == 2, job_ids   # different ports and job ids
