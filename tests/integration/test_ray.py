"""byteps_like on a real local Ray cluster of two nodes (``ray.cluster_utils.Cluster``): a head
node that runs the training workers (custom resource ``bps_train``) and a CPU-only node for the
servers (``bps_cpu``).

Ray is heavy, so one driver process (this file run as a script, under a watchdog that kills its
process group and shows its output on a hang) starts the cluster once, runs every scenario and
prints one JSON line per scenario; the tests read the module-scoped result:

- the executor runs a function on every worker, in rank order; push_pull sums are exact for
  every dtype; the servers run on the CPU-only node, the workers on the training node;
- examples/pytorch/train_digits.py trains through the Ray Train backend (2 workers, 2 server
  actors) to the same accuracy as under bpslaunch;
- a server actor killed mid-training: Ray Train retries from the last checkpoint
  (``FailureConfig(max_failures=1)``) and finishes; no byteps_like actor, placement group,
  process or shared-memory segment is left afterwards;
- after the cluster shuts down no process of it is left.

Skipped, with the reason, where Ray is not installed or cannot start a cluster.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "examples" / "pytorch" / "train_digits.py"
#: A killed server is noticed at once (its connections close), so the heartbeat timeout need not
#: be short; a short one (3 s) failed a healthy attempt on a machine loaded 20x over its cores.
FAST = {"BYTEPS_HEARTBEAT_INTERVAL_SECONDS": "1", "BYTEPS_HEARTBEAT_TIMEOUT_SECONDS": "30",
        "BYTEPS_REGISTER_TIMEOUT_SECONDS": "180", "BYTEPS_TIMEOUT_SECONDS": "120"}
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
RESULT = "RAYTEST "
CANNOT_START = "RAYTEST-CANNOT-START "
DIGITS_ARGS = ["--epochs", "10"]


# ====================================================================== the driver (a script)
def _emit(name: str, **data) -> None:
    print(RESULT + json.dumps({"scenario": name, **data}), flush=True)


def _node_ids(resource: str) -> list[str]:
    import ray
    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]


def _dtype_sums() -> dict:
    """On each worker: push_pull (sum) of a rank-dependent array of every dtype."""
    import numpy as np

    import byteps_like as bps
    bps.init()
    rank, out = bps.rank(), {}
    for dtype in DTYPES:
        values = _dtype_values(rank, dtype)
        got = bps.synchronize(bps.push_pull_async(values, name=f"sum.{dtype}", average=False,
                                                  dtype=dtype))
        out[dtype] = np.asarray(got).view(values.dtype).tolist()
    return {"rank": rank, "size": bps.size(), "sums": out, "pid": os.getpid(),
            "secret": os.environ.get("BYTEPS_AUTH_SECRET", "")}


def _on_a_command_line(text: str) -> list[int]:
    """The processes of this machine whose command line holds ``text``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if text.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
    return found


def _dtype_values(rank: int, dtype: str):
    """Values whose sum over two ranks is exact in ``dtype`` (bfloat16: raw uint16 bits of
    small integers, built without torch)."""
    import numpy as np
    base = np.arange(64, dtype=np.int64) % 17 + 3 * rank - 20
    if dtype == "bfloat16":
        f = base.astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16)
    return base.astype(dtype)


def _bf16_to_float(bits):
    import numpy as np
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32)


def scenario_executor() -> None:
    import numpy as np
    import ray

    from byteps_like.ray import RayExecutor
    t0 = time.monotonic()
    ex = RayExecutor(num_workers=2, num_servers=2, cpus_per_worker=1,
                     worker_resources={"bps_train": 1},
                     server_resources={"CPU": 1, "bps_cpu": 1}, env=FAST)
    ex.start()
    started = time.monotonic() - t0
    try:
        servers = [r.node_id for r in ex.job.roles if r.role == "server"]
        workers = ray.get([w.__ray_call__.remote(
            lambda self: ray.get_runtime_context().get_node_id()) for w in ex.workers])
        ranks = ex.run(lambda: __import__("byteps_like").init() or
                       __import__("byteps_like").rank())
        results = ex.run(_dtype_sums)
    finally:
        ex.shutdown()
    exact = {}
    for dtype in DTYPES:
        want = _dtype_values(0, dtype).astype(np.float64) if dtype != "bfloat16" else \
            _bf16_to_float(_dtype_values(0, dtype)).astype(np.float64)
        want = want + (_dtype_values(1, dtype).astype(np.float64) if dtype != "bfloat16" else
                       _bf16_to_float(_dtype_values(1, dtype)))
        got = [np.asarray(r["sums"][dtype]) for r in results]
        if dtype == "bfloat16":
            got = [_bf16_to_float(g.astype(np.uint16)) for g in got]
        exact[dtype] = all(np.array_equal(g.astype(np.float64), want) for g in got)
    secrets = {r["secret"] for r in results}
    secret = secrets.pop() if len(secrets) == 1 else ""
    _emit("executor", start_s=round(started, 2), ranks=ranks,
          one_secret=len(secret) == 64, secret_on_command_lines=_on_a_command_line(secret)
          if secret else None,
          results_ranks=[r["rank"] for r in results], sizes=[r["size"] for r in results],
          exact=exact, server_nodes=servers, worker_nodes=workers,
          cpu_nodes=_node_ids("bps_cpu"), train_nodes=_node_ids("bps_train"))


def _digits_loop(config: dict) -> None:
    """examples/pytorch/train_digits.py's own main(), in a Ray Train worker."""
    import importlib.util

    import ray.train
    spec = importlib.util.spec_from_file_location("train_digits", config["script"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    argv, sys.argv = sys.argv, [config["script"], *config["args"]]
    try:
        with contextlib.redirect_stdout(out):
            module.main()
    finally:
        sys.argv = argv
    text = out.getvalue()
    print(text, flush=True)
    m = re.search(r"final test accuracy: ([0-9.]+) \((\d+) workers", text)
    metrics = {"accuracy": float(m.group(1)) if m else -1.0,
               "workers": int(m.group(2)) if m else -1}
    # Ray Train V2 keeps the metrics of reports that carry a checkpoint
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        Path(d, "metrics.json").write_text(json.dumps(metrics))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))


def _trainer(loop, name: str, storage: str, config: dict, max_failures: int = 0,
             env: dict | None = None):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2._internal.constants import is_v2_enabled
    if is_v2_enabled():  # Ray Train V2, the default since Ray 2.5x
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
    else:
        from ray.train.data_parallel_trainer import DataParallelTrainer

    from byteps_like.ray import BytePSConfig
    return DataParallelTrainer(
        loop, train_loop_config=config,
        backend_config=BytePSConfig(num_servers=2, server_resources={"CPU": 1, "bps_cpu": 1},
                                    env={**FAST, **(env or {})}),
        scaling_config=ScalingConfig(num_workers=2,
                                     resources_per_worker={"CPU": 1, "bps_train": 1}),
        run_config=RunConfig(name=name, storage_path=storage,
                             failure_config=FailureConfig(max_failures=max_failures)))


def scenario_digits(storage: str) -> None:
    t0 = time.monotonic()
    result = _trainer(_digits_loop, "digits", storage,
                      {"script": str(DIGITS), "args": DIGITS_ARGS}).fit()
    _emit("digits", seconds=round(time.monotonic() - t0, 2), metrics=result.metrics,
          error=repr(result.error) if result.error else None)


def _steps(model, opt, g, doomed: bool) -> float:
    """Five training steps; on the doomed epoch rank 0 kills server 0's actor at step 2 and
    both workers go on stepping until byteps_like reports the lost server (at once when its
    connections close, else within the heartbeat timeout)."""
    import ray
    import torch

    import byteps_like.torch as bps
    from byteps_like.ray import actor_name
    step, deadline = 0, None
    while step < 5 or doomed:
        if doomed and step == 2:
            deadline = time.monotonic() + 150
            if bps.rank() == 0:
                server = ray.get_actor(actor_name(os.environ["BYTEPS_JOB_ID"], "server", 0))
                ray.kill(server)  # asynchronous: wait until its process is gone
                with contextlib.suppress(ray.exceptions.RayActorError):
                    for _ in range(120):
                        ray.get(server.status.remote(), timeout=30)
                        time.sleep(0.25)
                    raise AssertionError("the killed server actor still answers after 30 s")
        if deadline is not None and time.monotonic() > deadline:
            raise AssertionError("no PeerLostError 150 s after a server was killed")
        x = torch.randn(16, 8, generator=g)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
    return loss.item()


def _resume_loop(config: dict) -> None:
    """Trains a tiny model for ``epochs`` epochs, a checkpoint per epoch; on the first attempt
    rank 0 kills server 0's actor during epoch ``kill_at``."""
    import tempfile

    import ray
    import ray.train
    import torch

    import byteps_like.torch as bps
    bps.init()
    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 1)
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    start, resumed = 0, -1
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"))
        model.load_state_dict(state["model"])
        start = resumed = state["epoch"]
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    rank = bps.rank()  # asked once: after a lost peer every call of the runtime raises
    g = torch.Generator().manual_seed(rank)
    for epoch in range(start, config["epochs"]):
        # on the first attempt, epoch kill_at ends only by the error that fails the attempt
        doomed = ckpt is None and epoch == config["kill_at"]
        try:
            loss = _steps(model, opt, g, doomed)
        except BaseException as exc:  # what ended the first attempt, for the test to check
            with open(config["causes"], "a") as f:
                f.write(f"rank {rank}: {type(exc).__name__}: {str(exc)[:300]}\n")
            raise
        with tempfile.TemporaryDirectory() as d:
            torch.save({"model": model.state_dict(), "epoch": epoch + 1},
                       os.path.join(d, "state.pt"))
            ray.train.report({"epoch": epoch + 1, "resumed_from": resumed,
                              "job": os.environ["BYTEPS_JOB_ID"], "loss": loss},
                             checkpoint=ray.train.Checkpoint.from_directory(d))
    bps.shutdown()


def _leftovers() -> dict:
    """byteps_like actors, placement groups, processes and segments still there."""
    import ray
    named = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if str(a.get("name", "")).startswith("byteps_like-")]
    groups = [g for g in ray.util.placement_group_table().values()
              if str(g.get("name", "")).startswith("byteps_like-") and g.get("state") != "REMOVED"]
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    procs = [ln.strip() for ln in ps.splitlines()
             if "ray::RoleActor" in ln or "ray::_WorkerActor" in ln]
    shm = sorted(p for p in os.listdir("/dev/shm") if p.startswith("bpsl-ray-"))
    return {"actors": named, "groups": groups, "procs": procs, "shm": shm}


def _settled(deadline_s: float = 20.0) -> dict:
    """:func:`_leftovers` once empty, or what is left at the deadline (ray.kill is
    asynchronous: an actor's process exits a moment after)."""
    end = time.monotonic() + deadline_s
    while True:
        left = _leftovers()
        if not any(left.values()) or time.monotonic() > end:
            return left
        time.sleep(0.5)


def scenario_resume(storage: str) -> None:
    t0 = time.monotonic()
    causes = Path(storage, "causes.txt")
    result = _trainer(_resume_loop, "resume", storage,
                      {"epochs": 4, "kill_at": 1, "causes": str(causes)}, max_failures=1).fit()
    _emit("resume", seconds=round(time.monotonic() - t0, 2), metrics=result.metrics,
          causes=causes.read_text().splitlines() if causes.exists() else [],
          error=repr(result.error) if result.error else None, leftovers=_settled())


def _die_with_parent() -> None:
    """A watchdog thread: when the test process is gone (killed), stop this driver's whole
    session, Ray's processes included (Ray's workers sit in process groups of their own)."""
    import threading
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        kill_session(os.getsid(0))
    threading.Thread(target=watch, daemon=True).start()


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (this one last, if it is in it)."""
    import signal
    me = os.getpid()
    for pid in _session_pids(sid):
        if pid != me:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    if os.getsid(0) == sid:
        os.kill(me, signal.SIGKILL)


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
    return pids


def driver(scenarios: list[str]) -> int:
    import tempfile
    _die_with_parent()
    t0 = time.monotonic()
    try:
        import ray
        from ray.cluster_utils import Cluster
    except ImportError as exc:
        print(CANNOT_START + f"Ray is not installed ({exc}): pip install 'byteps_like[ray]'",
              flush=True)
        return 0
    common = {"object_store_memory": 80 * 1024 * 1024}
    try:
        # the head runs the driver, Ray Train's controller, the scheduler and the training
        # workers; the second node, CPU only, the servers
        cluster = Cluster(initialize_head=True, head_node_args={
            **common, "num_cpus": 3, "resources": {"bps_train": 2},
            "include_dashboard": False})
        cluster.add_node(**common, num_cpus=2, resources={"bps_cpu": 2})
        ray.init(address=cluster.address, logging_level="WARNING")
        cluster.wait_for_nodes()
    except Exception as exc:  # noqa: BLE001 - reported as the reason to skip
        print(CANNOT_START + f"{type(exc).__name__}: {exc}", flush=True)
        return 0
    _emit("cluster", start_s=round(time.monotonic() - t0, 2), nodes=len(ray.nodes()))
    code = 0
    with tempfile.TemporaryDirectory(prefix="bpsl-raytest-") as storage:
        for name in scenarios:
            try:
                if name == "executor":
                    scenario_executor()
                elif name == "digits":
                    scenario_digits(storage)
                elif name == "resume":
                    scenario_resume(storage)
            except Exception as exc:  # noqa: BLE001 - reported; the next scenario runs
                import traceback
                traceback.print_exc()
                _emit(name, error=f"{type(exc).__name__}: {exc}")
                code = 1
        _emit("leftovers", **_settled())
        ray.shutdown()
        cluster.shutdown()
    return code


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(driver(sys.argv[1:] or ["executor", "digits", "resume"]))


# ====================================================================== the tests (pytest)
import pytest  # noqa: E402

from tests.integration.harness import alive  # noqa: E402
from tests.support import clean_env, spawn, watch  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
#: A watchdog against hangs, not a speed limit: on an idle 2-core machine the driver takes about
#: 2 minutes, on one shared with a dozen other test processes 10 or more.
DRIVER_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def ray_run():
    import importlib.util
    for module, extra in (("ray", "ray"), ("torch", "torch"), ("sklearn", "examples")):
        if importlib.util.find_spec(module) is None:  # found, not imported: Ray is slow to load
            pytest.skip(f"{module} is not installed: pip install 'byteps_like[{extra}]'")
    env = clean_env("RAY_")
    env["PYTHONPATH"] = str(REPO)
    proc = spawn([sys.executable, __file__], env)
    rc, out, err = watch(proc, DRIVER_TIMEOUT_S, "the Ray driver",
                         on_hang=lambda: kill_session(proc.pid))
    log = f"exit {rc}\n--- stdout ---\n{out}\n--- stderr ---\n{err[-20000:]}"
    reason = next((ln[len(CANNOT_START):] for ln in out.splitlines()
                   if ln.startswith(CANNOT_START)), None)
    if reason is not None:
        pytest.skip(f"Ray cannot start a local cluster here: {reason}")
    results = {}
    for line in out.splitlines():
        if line.startswith(RESULT):
            data = json.loads(line[len(RESULT):])
            results[data.pop("scenario")] = data
    # the driver's session: Ray's own processes (raylets, GCS, workers) started inside it
    left = _session_processes(proc.pid)
    timings = {name: data.get("start_s", data.get("seconds")) for name, data in results.items()}
    print(f"Ray driver: {timings} (seconds; start_s: cluster, executor start)")  # pytest -s
    return results, log, left


def _session_processes(sid: int) -> list[str]:
    """The processes still in session ``sid`` 15 s after the driver exited (Ray's workers exit
    a moment after their raylet; a zombie nobody reaped yet does not count)."""
    deadline = time.monotonic() + 15
    while True:
        out = []
        for pid in _session_pids(sid):
            if not alive(pid):
                continue
            with contextlib.suppress(OSError):
                out.append(f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes()[:200]!r}")
        if not out or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if out:
        kill_session(sid)  # the test fails; leave nothing behind it either
    return out


def _get(results: tuple, name: str) -> dict:
    data, log, _ = results
    assert name in data, f"scenario {name} reported nothing\n{log}"
    assert not data[name].get("error"), f"scenario {name}: {data[name]['error']}\n{log}"
    return data[name]


@pytest.mark.timeout(DRIVER_TIMEOUT_S + 120)
def test_executor_runs_on_every_worker_with_exact_sums_and_placement(ray_run):
    r = _get(ray_run, "executor")
    log = ray_run[1]
    assert r["ranks"] == [0, 1] and r["results_ranks"] == [0, 1], log  # rank order
    assert r["sizes"] == [2, 2], log
    assert r["exact"] == {d: True for d in DTYPES}, log
    # authentication on by default: one 256-bit secret per job, through Ray, never on a
    # command line
    assert r["one_secret"] and r["secret_on_command_lines"] == [], log
    assert len(r["cpu_nodes"]) == 1 and len(r["train_nodes"]) == 1, log
    assert r["server_nodes"] == r["cpu_nodes"] * 2, log      # both servers on the CPU node
    assert r["worker_nodes"] == r["train_nodes"] * 2, log


@pytest.mark.timeout(DRIVER_TIMEOUT_S + 240)
def test_digits_example_through_ray_train_reaches_bpslaunch_accuracy(ray_run):
    from tests.integration.harness import bpslaunch
    r = _get(ray_run, "digits")
    log = ray_run[1]
    assert r["metrics"]["workers"] == 2, log
    assert r["metrics"]["accuracy"] >= 0.9, log  # as tests/frameworks/test_torch_examples.py
    # the same run under bpslaunch: the same seeds, shards and sums, so the same accuracy
    b = bpslaunch([str(DIGITS), *DIGITS_ARGS], workers=2, servers=2, timeout=120)
    assert b.rc == 0, b.log
    m = re.search(r"^\[worker 0\] final test accuracy: ([0-9.]+) \(2 workers", b.out, re.M)
    assert m, b.log
    print(f"digits accuracy: Ray Train {r['metrics']['accuracy']}, bpslaunch {m.group(1)}")
    assert r["metrics"]["accuracy"] == pytest.approx(float(m.group(1)), abs=0.01), \
        f"Ray Train {r['metrics']['accuracy']}, bpslaunch {m.group(1)}\n{log}\n{b.log}"


@pytest.mark.timeout(DRIVER_TIMEOUT_S + 120)
def test_killed_server_actor_retries_from_checkpoint_and_leaves_nothing(ray_run):
    r = _get(ray_run, "resume")
    log = ray_run[1]
    assert r["metrics"]["epoch"] == 4, log
    assert r["metrics"]["resumed_from"] == 1, log  # the second attempt started at epoch 1
    # the first attempt ended because byteps_like reported the lost server on a worker
    assert any("PeerLostError" in c for c in r["causes"]), log
    assert not any("AssertionError" in c for c in r["causes"]), log
    assert r["leftovers"] == {"actors": [], "groups": [], "procs": [], "shm": []}, log


@pytest.mark.timeout(DRIVER_TIMEOUT_S + 120)
def test_nothing_left_after_the_cluster_shuts_down(ray_run):
    left = _get(ray_run, "leftovers")
    data, log, session = ray_run
    assert left == {"actors": [], "groups": [], "procs": [], "shm": []}, log
    assert session == [], f"processes of the Ray driver's session still run: {session}\n{log}"


# ------------------------------------------------------------- bad settings: no cluster needed
@pytest.mark.parametrize("kwargs, needle", [
    ({"placement_strategy": "RANDOM"}, "placement_strategy='RANDOM': expected one of PACK"),
    ({"num_servers": -1}, "num_servers=-1: needs an integer >= 0"),
    ({"server_resources": {"CPU": -2}}, "server_resources['CPU']=-2 is not a number >= 0"),
    ({"server_resources": {"CPU": 0}}, "a placement-group bundle needs some resource > 0"),
    ({"env": {"DMLC_PS_ROOT_URI": "10.0.0.1"}}, "env sets DMLC_PS_ROOT_URI: the Ray integration"),
    ({"env": {"BYTEPS_LOG_LEVEL": 3}}, "expected a mapping of variable names to strings"),
    ({"start_timeout": 0}, "start_timeout=0: needs a number of seconds > 0"),
])
def test_bad_backend_settings_fail_in_the_driver_naming_the_setting(kwargs, needle):
    pytest.importorskip("ray")
    from byteps_like.errors import ConfigError
    from byteps_like.ray import BytePSConfig
    with pytest.raises(ConfigError) as info:
        BytePSConfig(**kwargs)
    assert needle in str(info.value)


def test_bad_executor_settings_fail_before_anything_starts():
    pytest.importorskip("ray")
    from byteps_like.errors import ConfigError
    from byteps_like.ray import RayExecutor
    with pytest.raises(ConfigError, match="num_servers=0 with 2 workers: a distributed job"):
        RayExecutor(num_workers=2, num_servers=0)
    with pytest.raises(ConfigError, match="num_workers=0: needs an integer >= 1"):
        RayExecutor(num_workers=0)
    with pytest.raises(ConfigError, match="gpus_per_worker=-1: needs a number >= 0"):
        RayExecutor(num_workers=1, gpus_per_worker=-1)
    with pytest.raises(ConfigError, match="a worker asks for no resources at all"):
        RayExecutor(num_workers=1, cpus_per_worker=0)
    with pytest.raises(RuntimeError, match="call start\\(\\) first"):
        RayExecutor(num_workers=1, num_servers=0).run(print)


def test_the_core_does_not_import_ray():
    code = ("import sys, byteps_like, byteps_like.config, byteps_like.launcher.cli, "
            "byteps_like.server.core, byteps_like.scheduler.core; "
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=clean_env())
    assert out.returncode == 0 and out.stdout.strip() == "False", out
