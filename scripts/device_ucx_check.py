"""UCX on a GPU machine: what UCX sees, and a 64 MiB tensor sent between two UcxEndpoints.

Run from the repository root (no install of byteps_like needed; ucxx & co. may come from a
``pip install --target`` directory on PYTHONPATH):

    PYTHONPATH=/tmp/site python scripts/device_ucx_check.py

It prints

* the Python / torch / CUDA / ucxx / UCX versions and where ucxx and libucx were loaded from;
* ``ucx_info -v`` (how UCX was built) and a ``ucx_info -d`` summary: the transports and devices
  UCX sees, and whether cuda_copy / cuda_ipc are among them;
* three trials, each between two processes on this machine (receiver: a UcxEndpoint bound to
  ucx://127.0.0.1:0, frames land in its host staging buffers; sender: a UcxEndpoint that
  connects to it), 1 warm-up + 5 timed rounds of one 64 MiB int32 tensor, every round's bytes
  checked on the receiver:
    - ``tcp-host``:    UCX_TLS=tcp, a host (CPU) tensor - the baseline, runs anywhere;
    - ``cuda-direct``: UCX_TLS=tcp,cuda_copy,cuda_ipc, the CUDA tensor handed to UCX as is
                       (BYTEPS_UCX_DEVICE_MEMORY=1's path);
    - ``cuda-staged``: UCX_TLS=tcp, the CUDA tensor copied to host by the sender (``.cpu()``,
                       timed too) - what byteps_like does when UCX has no CUDA support;
    - ``cuda-direct-hostfrag``, only if cuda-direct failed: the same with
                       UCX_RNDV_FRAG_MEM_TYPE=host (ucxx sets it to cuda when unset).
  A round's time is from the send until the receiver's "got it" reply arrives; the median of 5
  is reported as GB/s (1e9 B).

Every line that matters starts with PASS, FAIL or SKIP; the last line is ``RESULT: ...``.
Exit status: 0 when nothing failed (SKIPs allowed: no torch, no CUDA device), 1 on a failure,
3 when the watchdog fired. Every child has a hard time limit and runs in its own process group
(killed on any failure), and the whole check stops after ``--budget`` seconds (170 by default).
Only loopback is used (127.0.0.1, UCX_NET_DEVICES=lo).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)   # byteps_like from this checkout, installed or not

NBYTES = 64 << 20
ROUNDS = 5                      # timed rounds; one warm-up round comes first
TRIAL_TIMEOUT = 45.0            # seconds per trial (both processes)
INFO_TIMEOUT = 20.0             # seconds per ucx_info call
TLS_CUDA = "tcp,cuda_copy,cuda_ipc"
BASE_UCX_ENV = {"UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}

_children: list[subprocess.Popen] = []
_results: list[tuple[str, str, str]] = []


def say(status: str, name: str, detail: str) -> None:
    _results.append((status, name, detail))
    print(f"{status}: {name}: {detail}", flush=True)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def _start_watchdog(budget: float) -> None:
    def fire() -> None:
        print(f"FAIL: watchdog: the check ran past its budget of {budget:g} s; killing its "
              "children", flush=True)
        for p in list(_children):
            _kill(p)
        print("RESULT: FAIL (watchdog)", flush=True)
        os._exit(3)
    t = threading.Timer(budget, fire)
    t.daemon = True
    t.start()


# ------------------------------------------------------------------------------ information
def _libucx_dir() -> str | None:
    import importlib.util
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _ucx_info(args: list[str]) -> tuple[int, str]:
    """Run the wheel's ucx_info (it needs libucx/lib on LD_LIBRARY_PATH: its RPATH lacks it)."""
    d = _libucx_dir()
    exe = os.path.join(d, "bin", "ucx_info") if d else None
    if exe is None or not os.access(exe, os.X_OK):
        return -1, "ucx_info not found in the libucx package"
    env = {**os.environ, **BASE_UCX_ENV}
    env["LD_LIBRARY_PATH"] = os.path.join(d, "lib") + (
        os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    env.pop("UCX_TLS", None)   # list everything UCX could use
    try:
        r = subprocess.run([exe, *args], env=env, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=INFO_TIMEOUT)
    except subprocess.TimeoutExpired:
        return -1, f"ucx_info {' '.join(args)} timed out after {INFO_TIMEOUT:g} s"
    return r.returncode, r.stdout + r.stderr


def print_info() -> dict:
    info: dict = {"torch": None, "cuda": False}
    print(f"python {platform.python_version()} ({sys.executable}), {platform.platform()}")
    print(f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}")
    try:
        import numpy
        print(f"numpy {numpy.__version__} from {os.path.dirname(numpy.__file__)}")
    except ImportError as exc:
        say("FAIL", "numpy", f"not importable ({exc}); byteps_like needs it")
    try:
        import torch
        info["torch"] = torch.__version__
        info["cuda"] = bool(torch.cuda.is_available())
        dev = (f"{torch.cuda.device_count()} device(s), 0 = {torch.cuda.get_device_name(0)}, "
               f"CUDA runtime {torch.version.cuda}" if info["cuda"] else "no CUDA device visible")
        print(f"torch {torch.__version__}: {dev}")
    except ImportError as exc:
        print(f"torch: not importable ({exc})")
    try:
        import ucxx
        print(f"ucxx {getattr(ucxx, '__version__', '?')} from {os.path.dirname(ucxx.__file__)}; "
              f"UCX {ucxx.__ucx_version__} (libucx package: {_libucx_dir()})")
        say("PASS", "import ucxx", f"UCX {ucxx.__ucx_version__}")
        info["ucxx"] = True
    except Exception as exc:  # noqa: BLE001
        say("FAIL", "import ucxx", f"{type(exc).__name__}: {exc} (install the wheels: pip install "
            "--no-index --no-deps --target /tmp/site .whl/*.whl, run with PYTHONPATH=/tmp/site)")
        info["ucxx"] = False
        return info
    import byteps_like
    print(f"byteps_like from {os.path.dirname(byteps_like.__file__)}")

    rc, out = _ucx_info(["-v"])
    for line in out.splitlines():
        if line.startswith(("# Library version", "# Library path", "# Configured with")):
            print("ucx_info -v: " + line.lstrip("# "))
    rc, out = _ucx_info(["-d"])
    pairs, tl = [], None
    for line in out.splitlines():
        s = line.strip().lstrip("#").strip()
        if s.startswith("Transport:"):
            tl = s.split(":", 1)[1].strip()
        elif s.startswith("Device:") and tl:
            pairs.append(f"{tl}/{s.split(':', 1)[1].strip()}")
    info["tls"] = sorted({p.split("/")[0] for p in pairs})
    if rc != 0 or not pairs:
        say("FAIL", "ucx_info -d", f"exit {rc}: {out.strip()[-400:]}")
    else:
        print(f"ucx_info -d: transports/devices: {', '.join(pairs)}")
        have = [t for t in ("cuda_copy", "cuda_ipc", "gdr_copy", "rc", "rc_mlx5", "ud", "dc")
                if t in info["tls"]]
        print(f"ucx_info -d: CUDA / RDMA transports present: {', '.join(have) or 'none'}")
        if "cuda_copy" in info["tls"]:
            say("PASS", "UCX CUDA transports", f"cuda_copy{' and cuda_ipc' if 'cuda_ipc' in info['tls'] else ''} "
                "available")
        elif info["cuda"]:
            say("FAIL", "UCX CUDA transports", "a CUDA device is visible but UCX lists no "
                "cuda_copy transport (driver libcuda not found by UCX? ucx_info -d shows why)")
        else:
            say("SKIP", "UCX CUDA transports", "no cuda_copy (no CUDA device / driver here)")
    return info


# ---------------------------------------------------------------------------------- children
def _child_common(timeout: float) -> None:
    import faulthandler
    faulthandler.dump_traceback_later(timeout, exit=True)   # a hung child explains itself
    import logging
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")


def child_recv(a) -> int:
    _child_common(a.timeout)
    import queue

    import numpy as np

    from byteps_like.transport.ucx_transport import UcxEndpoint
    ep = UcxEndpoint("check-recv", ucx_env=dict(os.environ), max_message_bytes=a.nbytes + 65536)
    todo: queue.Queue = queue.Queue()

    def on_message(route, frames):
        if frames[0] == b"data":
            ep.send(route, [b"got", frames[1]])       # answer first: the sender's clock stops
            todo.put((route, int(frames[1]), frames[2]))
        elif frames[0] == b"bye":
            todo.put(None)
    ep.on_message = on_message
    addr = ep.bind("ucx://127.0.0.1:0")
    ep.start()
    print(f"ADDR {addr} cuda_support={ep.cuda_support}", flush=True)
    base = np.arange(a.nbytes // 4, dtype=np.int32)
    checked = []
    try:
        while True:
            item = todo.get(timeout=a.timeout)
            if item is None:
                break
            route, r, buf = item
            got = np.asarray(buf).view(np.uint8)
            ok = got.nbytes == a.nbytes and bool(np.array_equal(got.view(np.int32), base + r))
            checked.append(ok)
            ep.send(route, [b"ok", str(r).encode(), b"1" if ok else b"0"])
    finally:
        print("RECV_RESULT " + json.dumps({"checked": checked, "cuda_support": ep.cuda_support,
                                           "stats": dict(ep.stats)}), flush=True)
        ep.close()
    return 0


def child_send(a) -> int:
    _child_common(a.timeout)
    import numpy as np

    from byteps_like.transport import Route
    from byteps_like.transport.ucx_transport import UcxEndpoint
    torch = None
    try:
        import torch
    except ImportError:
        if a.mode != "host":
            raise
    ep = UcxEndpoint("check-send", ucx_env=dict(os.environ), device_memory=a.mode == "cuda")
    if a.mode == "cuda" and not ep.cuda_support:
        print("SEND_RESULT " + json.dumps({"error": "the UCX context has no CUDA support with "
                                           f"UCX_TLS={os.environ.get('UCX_TLS')}"}), flush=True)
        ep.close()
        return 0
    got: dict[int, threading.Event] = {}
    ok: dict[int, tuple[threading.Event, list]] = {}
    for r in range(ROUNDS + 1):
        got[r] = threading.Event()
        ok[r] = (threading.Event(), [])

    def on_message(route, frames):
        if frames[0] == b"got":
            got[int(frames[1])].set()
        elif frames[0] == b"ok":
            ev, res = ok[int(frames[1])]
            res.append(frames[2] == b"1")
            ev.set()
    ep.on_message = on_message
    ep.start()
    ep.connect("r", a.addr)
    n = a.nbytes // 4
    times, oks = [], []
    wait = max(5.0, a.timeout / (ROUNDS + 2))
    for r in range(ROUNDS + 1):       # round 0 is the warm-up (and the connection set-up)
        if torch is None:
            payload = np.arange(n, dtype=np.int32) + r
        elif a.mode == "host":
            payload = (torch.arange(n, dtype=torch.int32) + r).numpy()
        else:
            x = torch.arange(n, dtype=torch.int32, device="cuda") + r
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if a.mode == "staged":
            payload = x.cpu().numpy()        # device -> host copy, part of the time
        elif a.mode == "cuda":
            payload = x                      # handed to UCX as device memory
        ep.send(Route(peer="r"), [b"data", str(r).encode(), payload])
        if not got[r].wait(wait):
            print("SEND_RESULT " + json.dumps({"error": f"round {r}: no answer in {wait:.0f} s",
                                               "times": times, "stats": dict(ep.stats)}),
                  flush=True)
            ep.close()
            return 0
        dt = time.perf_counter() - t0
        if not ok[r][0].wait(wait):
            print("SEND_RESULT " + json.dumps({"error": f"round {r}: not verified in {wait:.0f} s"}),
                  flush=True)
            ep.close()
            return 0
        oks.append(ok[r][1][0])
        if r:
            times.append(dt)
    ep.send(Route(peer="r"), [b"bye"])
    time.sleep(0.2)
    print("SEND_RESULT " + json.dumps({"times": times, "oks": oks,
                                       "cuda_support": ep.cuda_support}), flush=True)
    ep.close()
    return 0


# --------------------------------------------------------------------------------- the trials
def _spawn(argv: list[str], env: dict, out_path: str) -> subprocess.Popen:
    with open(out_path, "wb") as f:
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=env,
                             stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True, close_fds=True)
    _children.append(p)
    return p


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _tagged(text: str, tag: str):
    lines = [ln for ln in text.splitlines() if ln.startswith(tag)]
    return lines[-1][len(tag):].strip() if lines else None


def trial(name: str, mode: str, tls: str, timeout: float, extra_env: dict | None = None) -> None:
    env = {**os.environ, **BASE_UCX_ENV, "UCX_TLS": tls, **(extra_env or {})}
    tls = tls + "".join(f" {k}={v}" for k, v in (extra_env or {}).items())   # for the report
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    common = ["--nbytes", str(NBYTES), "--timeout", f"{timeout:.1f}"]
    with tempfile.TemporaryDirectory(prefix="ucxcheck-") as tmp:
        rpath, spath = os.path.join(tmp, "recv.log"), os.path.join(tmp, "send.log")
        recv = _spawn(["--_role", "recv", *common], env, rpath)
        send = None
        deadline = time.monotonic() + timeout
        try:
            addr = None
            while addr is None and time.monotonic() < deadline and recv.poll() is None:
                addr = _tagged(_read(rpath), "ADDR ")
                time.sleep(0.05)
            if addr is None:
                say("FAIL", name, f"the receiver did not bind (UCX_TLS={tls}): "
                    f"{_read(rpath).strip()[-800:] or '(no output)'}")
                return
            send = _spawn(["--_role", "send", "--mode", mode, "--addr", addr.split()[0],
                           *common], env, spath)
            for p in (send, recv):
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    break
            sres = _tagged(_read(spath), "SEND_RESULT ")
            rres = _tagged(_read(rpath), "RECV_RESULT ")
            if sres is None:
                state = "timed out" if send.poll() is None else f"exited {send.returncode}"
                say("FAIL", name, f"the sender {state} without a result (UCX_TLS={tls}); its "
                    f"output: {_read(spath).strip()[-1200:] or '(none)'}; the receiver's: "
                    f"{_read(rpath).strip()[-600:] or '(none)'}")
                return
            s = json.loads(sres)
            if "error" in s:
                status = "SKIP" if "no CUDA support" in s["error"] else "FAIL"
                say(status, name, f"{s['error']}; receiver: {_read(rpath).strip()[-600:]}")
                return
            checked = json.loads(rres)["checked"] if rres else s["oks"]
            times = s["times"]
            med = statistics.median(times)
            good = all(s["oks"]) and all(checked) and len(times) == ROUNDS
            say("PASS" if good else "FAIL", name,
                f"{NBYTES >> 20} MiB x {ROUNDS} (+1 warm-up), UCX_TLS={tls}: median "
                f"{med * 1e3:.1f} ms = {NBYTES / med / 1e9:.2f} GB/s (min {min(times) * 1e3:.1f}, "
                f"max {max(times) * 1e3:.1f} ms); bytes verified on the receiver: "
                f"{'all match' if good else 'MISMATCH ' + str(s['oks']) + ' ' + str(checked)}; "
                f"context cuda_support="
                f"{s.get('cuda_support')}")
        finally:
            for p in (send, recv):
                if p is not None:
                    _kill(p)
                    _children.remove(p)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=float, default=170.0,
                   help="seconds for the whole check; the watchdog then kills everything")
    p.add_argument("--_role", choices=("recv", "send"), help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=("host", "cuda", "staged"), help=argparse.SUPPRESS)
    p.add_argument("--addr", help=argparse.SUPPRESS)
    p.add_argument("--nbytes", type=int, default=NBYTES, help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=TRIAL_TIMEOUT, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a._role == "recv":
        return child_recv(a)
    if a._role == "send":
        return child_send(a)

    t_start = time.monotonic()
    _start_watchdog(a.budget)
    info = print_info()
    if info.get("ucxx"):
        trials = [("tcp-host", "host", "tcp", True, "")]
        why = ("torch is not importable" if info["torch"] is None else
               "no CUDA device visible to torch")
        trials += [("cuda-direct", "cuda", TLS_CUDA, info["cuda"], why),
                   ("cuda-staged", "staged", "tcp", info["cuda"], why)]
        for name, mode, tls, runnable, why_not in trials:
            left = a.budget - (time.monotonic() - t_start) - 5.0
            if not runnable:
                say("SKIP", name, why_not)
            elif left < 15.0:
                say("SKIP", name, f"only {left:.0f} s of the budget left")
            else:
                trial(name, mode, tls, min(TRIAL_TIMEOUT, left))
                left = a.budget - (time.monotonic() - t_start) - 5.0
                if name == "cuda-direct" and _results[-1][0] == "FAIL" and left >= 15.0:
                    # ucxx sets UCX_RNDV_FRAG_MEM_TYPE=cuda when unset; try host fragments too
                    trial("cuda-direct-hostfrag", mode, tls, min(TRIAL_TIMEOUT, left),
                          {"UCX_RNDV_FRAG_MEM_TYPE": "host"})
    fails = sum(1 for s, _n, _d in _results if s == "FAIL")
    passes = sum(1 for s, _n, _d in _results if s == "PASS")
    skips = sum(1 for s, _n, _d in _results if s == "SKIP")
    print(f"RESULT: {'FAIL' if fails else 'PASS'} ({passes} passed, {fails} failed, {skips} "
          f"skipped) in {time.monotonic() - t_start:.0f} s", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
