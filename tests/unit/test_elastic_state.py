"""Unit tests of the elastic API (byteps_like.worker.elastic, byteps_like.elastic,
byteps_like.torch.elastic) with no cluster.

Workers are threads; each talks to a :class:`FakeRuntime` of one :class:`FakeWorld` that
implements the runtime's elastic interface (rank, size, epoch, push_pull that sums across the
current epoch's workers, check_membership, rejoin) in memory. The world changes membership as a
real job would: a lost worker voids the collectives of its epoch (they raise
MembershipChangedError), a joining worker waits to be admitted at the next commit.
"""
from __future__ import annotations

import sys
import threading
import zlib

import numpy as np
import pytest

from byteps_like import elastic
from byteps_like.errors import MembershipChangedError
from byteps_like.worker import elastic as core

DEADLINE = 20.0


class Died(BaseException):
    """Ends a worker thread as a SIGKILL would: nothing of it runs afterwards."""


class FakeHandle:
    def __init__(self, rt, key, out, average):
        self.rt, self.key, self.out, self.average = rt, key, out, average

    def wait(self, timeout=None):
        w = self.rt.world
        with w.cond:
            def complete():
                return len(w.pending[self.key]) == self.rt.size_

            ok = w.cond.wait_for(lambda: w.epoch != self.key[0] or complete(), DEADLINE)
            assert ok, f"fake collective {self.key} hung"
            if not complete():  # a round that completed is answered, as by a server
                raise w.error(self.rt)
            total = sum(w.pending[self.key].values())
        self.out[...] = total / self.rt.size_ if self.average else total
        return self.out


class FakeRuntime:
    elastic = True

    def __init__(self, world, wid):
        self.world, self.wid = world, wid
        self.epoch = 0
        self.rank_ = self.size_ = 0
        self.rounds: dict[str, int] = {}
        self.rejoins = 0

    def rank(self):
        return self.rank_

    def size(self):
        return self.size_

    def check(self):
        pass

    def _adopt(self):
        w = self.world
        self.epoch, self.rank_, self.size_ = w.epoch, w.members.index(self.wid), len(w.members)
        self.rounds = {}

    def push_pull_async(self, arr, name=None, average=True, priority=0, out=None, dtype=None,
                        **_):
        w = self.world
        rnd = self.rounds.get(name, 0)
        self.rounds[name] = rnd + 1
        key = (self.epoch, name, rnd)
        with w.cond:
            if w.epoch != self.epoch:
                raise w.error(self)
            w.pending.setdefault(key, {})[self.rank_] = np.array(arr, copy=True)
            w.cond.notify_all()
        return FakeHandle(self, key, arr if out is None else out, average)

    def check_membership(self):
        w = self.world
        with w.cond:
            if w.epoch != self.epoch or w.joiners:
                raise w.error(self)

    def rejoin(self, timeout=None):
        w = self.world
        self.rejoins += 1
        with w.cond:
            if w.epoch == self.epoch and w.joiners:  # admit the joiners: a new epoch
                w.new_epoch(w.members + w.joiners, lost=())
                w.joiners = []
            self._adopt()


class FakeWorld:
    def __init__(self, n):
        self.cond = threading.Condition()
        self.members = list(range(n))
        self.epoch = 1
        self.pending: dict = {}
        self.lost: tuple[str, ...] = ()
        self.joiners: list[int] = []
        self.next_id = n
        self.errors: list[BaseException] = []

    def new_epoch(self, members, lost):
        self.members, self.lost, self.epoch = list(members), tuple(lost), self.epoch + 1
        self.cond.notify_all()

    def error(self, rt):
        lost = self.lost if rt.epoch < self.epoch else ()
        return MembershipChangedError(f"epoch {self.epoch}", epoch=self.epoch, lost=lost,
                                      added=len(self.joiners))

    def runtime(self, wid):
        rt = FakeRuntime(self, wid)
        rt._adopt()
        return rt

    def die(self, rt):
        with self.cond:
            self.new_epoch([m for m in self.members if m != rt.wid],
                           lost=(f"worker rank {rt.rank_} (id {rt.wid})",))
        raise Died

    def join(self):
        """A new worker's init(): wait to be admitted into the next epoch."""
        with self.cond:
            wid = self.next_id
            self.next_id += 1
            self.joiners.append(wid)
            ok = self.cond.wait_for(lambda: wid in self.members, DEADLINE)
            assert ok, "the joiner was never admitted"
            return self.runtime(wid)


@pytest.fixture
def world(monkeypatch):
    local = threading.local()
    monkeypatch.setattr(core, "runtime", lambda: local.rt)
    # the torch plugin's broadcast functions find their runtime themselves (the module is
    # shadowed by the function of its name in byteps_like.torch: take it from sys.modules)
    torch_broadcast = sys.modules.get("byteps_like.torch.broadcast")
    if torch_broadcast is not None:
        monkeypatch.setattr(torch_broadcast, "default_runtime", lambda: local.rt)

    def start(world, fn, *args, rt=None, join=False):
        def body():
            try:
                local.rt = world.join() if join else rt
                fn(local.rt, *args)
            except Died:
                pass
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                world.errors.append(exc)
        t = threading.Thread(target=body, daemon=True)
        t.start()
        return t

    class W:
        make = FakeWorld

        @staticmethod
        def run(w, fns):
            threads = [start(w, fn, rt=w.runtime(i)) for i, fn in enumerate(fns)]
            return threads

        @staticmethod
        def spawn_joiner(w, fn):
            return start(w, fn, join=True)

        @staticmethod
        def finish(w, threads):
            for t in threads:
                t.join(DEADLINE)
                assert not t.is_alive(), "a worker thread hung"
            if w.errors:
                raise w.errors[0]

        set_local = staticmethod(lambda rt: setattr(local, "rt", rt))

    return W


def checksum(arr: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(arr).tobytes())


# -- the state alone ----------------------------------------------------------------------------
def test_extras_are_attributes_saved_by_commit_and_brought_back_by_restore(world):
    w = world.make(1)
    world.set_local(w.runtime(0))
    state = elastic.ObjectState(step=0, history=[1], lr=0.1)
    state.step, state.lr = 5, 0.2
    state.history.append(2)
    state.commit()
    state.step = 9
    state.history.append(3)
    state.restore()
    assert (state.step, state.history, state.lr) == (5, [1, 2], 0.2)
    assert state.extras == {"step": 5, "history": [1, 2], "lr": 0.2}


def test_numpy_extras_are_restored_in_place(world):
    w = world.make(1)
    world.set_local(w.runtime(0))
    weights = np.arange(4, dtype=np.float32)
    state = elastic.ObjectState(w=weights)
    state.w += 1
    state.commit()
    weights *= 100          # the user's own reference
    state.restore()
    assert state.w is weights
    np.testing.assert_array_equal(weights, [1, 2, 3, 4])


def test_bad_extras_and_callbacks_are_refused_with_their_names():
    with pytest.raises(ValueError, match="'commit'"):
        elastic.ObjectState(commit=1)
    with pytest.raises(ValueError, match="'_hidden'"):
        elastic.ObjectState(_hidden=1)
    state = elastic.ObjectState(step=0)
    with pytest.raises(TypeError, match="not callable"):
        state.register_reset_callbacks([1])


def test_run_refuses_a_first_argument_that_is_no_state():
    @elastic.run
    def train(state):
        return state

    with pytest.raises(TypeError, match="elastic State"):
        train(3)


# -- run() across membership changes ------------------------------------------------------------
STEPS = 12


def numpy_worker(log, kill_at=None, commit_every=1):
    """A training loop: w -= 0.01 * (sum of the ranks' gradients); records (step, size,
    checksum of w) after every step."""

    def fn(rt):
        state = elastic.ObjectState(w=np.full(8, float(rt.wid + 1), np.float64), step=0)
        resets = []
        state.register_reset_callbacks([lambda: resets.append(rt.size())])

        @elastic.run
        def train(state):
            while state.step < STEPS:
                if kill_at is not None and state.step == kill_at:
                    rt.world.die(rt)  # while the others wait for its push of the next step
                g = np.arange(8, dtype=np.float64) * (rt.rank() + 1)
                s = rt.push_pull_async(g, name="grad", average=False).wait()
                state.w -= 0.01 * s
                state.step += 1
                log.append((rt.wid, state.step, rt.size(), checksum(state.w)))
                if state.step % commit_every == 0:
                    state.commit()
            return state

        out = train(state)
        log.append((rt.wid, "done", tuple(resets), checksum(out.w), rt.rejoins))
    return fn


def test_a_lost_worker_survivors_resume_in_step_and_finish_the_plan(world):
    w = world.make(3)
    log: list = []
    threads = world.run(w, [numpy_worker(log), numpy_worker(log),
                            numpy_worker(log, kill_at=5)])
    world.finish(w, threads)
    done = {e[0]: e for e in log if e[1] == "done"}
    assert set(done) == {0, 1}, done
    # after every step the survivors hold the same parameters
    by_step: dict = {}
    for wid, step, size, crc in (e for e in log if e[1] != "done"):
        by_step.setdefault((step, size), {})[wid] = crc
    for (step, n), crcs in by_step.items():
        assert len(set(crcs.values())) == 1, f"step {step} of {n}: parameters differ {crcs}"
    # every step 1..STEPS ran exactly once with each membership it belonged to
    steps_after = sorted(s for (s, n) in by_step if n == 2)
    assert steps_after == list(range(6, STEPS + 1)), steps_after
    assert sorted(s for (s, n) in by_step if n == 3) == list(range(1, 6))
    # one reset, at size 2; the final parameters equal
    assert done[0][2] == done[1][2] == (2,)
    assert done[0][3] == done[1][3]


def test_losing_rank_0_syncs_from_the_lowest_survivor_after_restoring_the_commit(world):
    w = world.make(3)
    seen: dict = {}

    def fn(rt):
        state = elastic.ObjectState(value=np.zeros(1), who=-1)

        @elastic.run
        def train(state):
            if rt.size() == 3:
                state.who = rt.wid
                state.commit()                  # the ranks' commits differ...
                state.value += rt.wid + 10      # ...and this change is never committed
                if rt.wid == 0:
                    rt.world.die(rt)           # ...and rank 0 goes
                rt.push_pull_async(np.ones(1), name="x").wait()
            seen[rt.wid] = (float(state.value[0]), state.who, rt.rank(), rt.size())

        train(state)

    threads = world.run(w, [fn, fn, fn])
    world.finish(w, threads)
    # the uncommitted change was discarded; the commit taken is the new rank 0's (old id 1)
    assert seen == {1: (0.0, 1, 0, 2), 2: (0.0, 1, 1, 2)}


def test_a_joiner_is_admitted_at_the_next_commit_and_holds_the_same_state(world):
    w = world.make(2)
    log: list = []
    extra: list = []

    def spawner(rt):
        orig = rt.push_pull_async

        def pp(arr, name=None, **kw):   # a worker starts while step 4 is under way
            if name == "grad" and rt.rounds.get("grad", 0) == 3 and not extra:
                extra.append(world.spawn_joiner(w, numpy_worker(log)))
            return orig(arr, name, **kw)
        rt.push_pull_async = pp
        numpy_worker(log)(rt)

    world.finish(w, world.run(w, [spawner, numpy_worker(log)]))
    world.finish(w, extra)
    done = {e[0]: e for e in log if e[1] == "done"}
    assert set(done) == {0, 1, 2}, log
    steps = [e for e in log if e[1] != "done"]
    first_of_joiner = min(s for wid, s, _n, _c in steps if wid == 2)
    by_step: dict = {}
    for wid, step, size, crc in steps:
        by_step.setdefault(step, {}).setdefault(size, {})[wid] = crc
    # the joiner's first step is one the others also ran at size 3, with the same parameters
    assert set(by_step[first_of_joiner][3]) == {0, 1, 2}
    for step, sizes in by_step.items():
        for size, crcs in sizes.items():
            assert len(set(crcs.values())) == 1, f"step {step} size {size}: {crcs}"
    # every step ran once on each worker that was there, none lost or repeated
    for wid in (0, 1):
        assert sorted(s for i, s, _n, _c in steps if i == wid) == list(range(1, STEPS + 1))
    assert sorted(s for i, s, _n, _c in steps if i == 2) == list(
        range(first_of_joiner, STEPS + 1))
    assert done[0][2] == done[1][2] == (3,) and done[2][2] == ()


# -- the PyTorch state and sampler ---------------------------------------------------------------
torch = pytest.importorskip("torch")


def test_elastic_sampler_resplits_what_is_left_of_the_epoch(world):
    from byteps_like.torch.elastic import ElasticSampler
    w = world.make(2)
    rts = [w.runtime(0), w.runtime(1)]
    data = list(range(21))
    samplers = []
    for rt in rts:
        world.set_local(rt)
        s = ElasticSampler(data, shuffle=True, seed=3)
        s.set_epoch(1)
        samplers.append(s)
    parts = [list(iter(s)) for s in samplers]
    assert len(parts[0]) == len(parts[1]) == 11
    assert set(parts[0]) | set(parts[1]) == set(data)
    for s in samplers:
        s.record_batch(0, 4)
        s.record_batch(1, 4)
    done = set(parts[0][:8]) | set(parts[1][:8])
    assert samplers[0].processed_indices == samplers[1].processed_indices == done
    # three workers now: the 21 - 16 = 5 samples left, split 2/2/1 (+1 padding)
    with w.cond:
        w.new_epoch([0, 1, 2], lost=())
    rts.append(w.runtime(2))
    for rt in rts:
        rt._adopt()
    s3 = ElasticSampler(data, shuffle=True, seed=3)   # a joiner knows nothing yet
    world.set_local(rts[2])
    s3.reset()
    samplers.append(s3)
    out: dict = {}

    def sync(i, rt):
        world.set_local(rt)
        samplers[i].sync(rt, "sampler")
        out[i] = list(iter(samplers[i]))

    ts = [threading.Thread(target=sync, args=(i, rt)) for i, rt in enumerate(rts)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(DEADLINE)
    assert all(s.epoch == 1 and s.processed_indices == done for s in samplers)
    left = set(data) - done
    assert [len(out[i]) for i in range(3)] == [2, 2, 2]
    assert set(out[0]) | set(out[1]) | set(out[2]) == left
    assert not (set(out[0]) & set(out[1])) and not (set(out[1]) & set(out[2]))
    # a new epoch starts over with everything
    samplers[0].set_epoch(2)
    assert samplers[0].processed_indices == set() and len(samplers[0]) == 7


def test_torch_state_sync_restore_and_extras(world):
    from byteps_like.torch.elastic import ElasticSampler, TorchState
    w = world.make(2)
    results: dict = {}

    def fn(rt):
        torch.manual_seed(rt.wid)        # different initial weights on each rank
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sampler = ElasticSampler(list(range(10)), shuffle=False)
        state = TorchState(model=model, optimizer=opt, sampler=sampler, epoch=rt.wid,
                           note=torch.tensor([float(rt.wid)]))
        state.sync()
        assert state.model is model and state.optimizer is opt and state.sampler is sampler
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        state.epoch += 1
        state.commit()
        after_commit = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        state.epoch = 99
        state.restore()
        results[rt.wid] = (state.epoch, float(state.note[0]),
                           [p.detach().clone() for p in model.parameters()], after_commit,
                           opt.state_dict()["state"][0]["momentum_buffer"].clone(),
                           list(iter(sampler)))

    world.finish(w, world.run(w, [fn, fn]))
    (e0, n0, p0, c0, m0, s0), (e1, n1, p1, _c1, m1, s1) = results[0], results[1]
    assert e0 == e1 == 1 and n0 == n1 == 0.0      # rank 0's extras
    for a, b, c in zip(p0, p1, c0):
        assert torch.equal(a, b) and torch.equal(a, c)   # synced, then restored to the commit
    assert torch.equal(m0, m1)
    assert s0 == [0, 2, 4, 6, 8] and s1 == [1, 3, 5, 7, 9]
