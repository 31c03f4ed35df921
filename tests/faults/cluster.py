"""An in-process cluster (scheduler, servers and workers as threads of the test process, over TCP
loopback) for the stall inspector, hostile-input and authentication tests."""
from __future__ import annotations

import contextlib
import threading

from byteps_like.config import load
from byteps_like.scheduler import Scheduler
from byteps_like.server import Server
from byteps_like.worker.runtime import Runtime
from tests.support import free_port

__all__ = ["Cluster", "WorkerGroup", "cluster_env", "free_port", "running_cluster"]


def cluster_env(port: int, workers: int = 2, servers: int = 1, **extra: str) -> dict:
    env = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
           "DMLC_NUM_WORKER": str(workers), "DMLC_NUM_SERVER": str(servers),
           "BYTEPS_REGISTER_TIMEOUT_SECONDS": "30", "BYTEPS_HEARTBEAT_INTERVAL_SECONDS": "0.5",
           "BYTEPS_HEARTBEAT_TIMEOUT_SECONDS": "5", "BYTEPS_SERVER_ENGINE_THREAD": "2"}
    env.update(extra)
    return env


class WorkerGroup:
    """What every test cluster does with its ``workers`` (Runtimes of this process)."""
    workers: list

    def run_all(self, fn, timeout: float = 60) -> list:
        """fn(worker) on every worker at once; returns the results (or raised exceptions)."""
        outs: list = [None] * len(self.workers)

        def go(i: int) -> None:
            try:
                outs[i] = fn(self.workers[i])
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                outs[i] = exc
        ts = [threading.Thread(target=go, args=(i,), daemon=True)
              for i in range(len(self.workers))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout)
        return outs

    def push_pull(self, value_of, name: str, timeout: float = 30) -> list:
        return self.run_all(lambda w: w.push_pull_async(value_of(w.rank()), name=name,
                                                        average=False).wait(timeout))


class Cluster(WorkerGroup):
    def __init__(self, env: dict):
        self.env = env
        self.sched = Scheduler(load(env={**env, "DMLC_ROLE": "scheduler"}))
        self.sched.start()
        n_srv = int(env["DMLC_NUM_SERVER"])
        self.servers = [Server(load(env={**env, "DMLC_ROLE": "server"})) for _ in range(n_srv)]
        self.server_threads = [threading.Thread(target=s.run, daemon=True) for s in self.servers]
        for t in self.server_threads:
            t.start()
        n = int(env["DMLC_NUM_WORKER"])
        self.workers = [Runtime(load(env={**env, "DMLC_ROLE": "worker",
                                          "DMLC_WORKER_ID": str(i)})) for i in range(n)]
        self.run_all(lambda w: w.init())
        assert all(w.initialized for w in self.workers)

    @property
    def server(self) -> Server:
        return self.servers[0]

    def close(self, expect_clean: bool = True) -> None:
        ts = [threading.Thread(target=w.shutdown, daemon=True) for w in self.workers]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        code = self.sched.wait(30)
        for t in self.server_threads:
            t.join(30)
        self.sched.close()
        if expect_clean:
            assert code == 0, self.sched.failure


@contextlib.contextmanager
def running_cluster(**kw):
    port = kw.pop("port", None) or free_port()
    extra = kw.pop("extra", {})
    c = Cluster(cluster_env(port, **kw, **extra))
    ok = False
    try:
        yield c
        ok = True
    finally:
        c.close(expect_clean=ok and not getattr(c, "failed_on_purpose", False))
