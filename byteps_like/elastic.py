"""Elastic training on numpy (``import byteps_like as bps``; docs/elastic.md).

    import numpy as np
    import byteps_like as bps
    from byteps_like import elastic

    bps.init()
    state = elastic.ObjectState(w=np.zeros(10, np.float32), step=0)

    @elastic.run
    def train(state):
        while state.step < 100:
            grad = ...                                   # from state.w
            state.w -= 0.1 * bps.push_pull(grad, name="grad")
            state.step += 1
            if state.step % 10 == 0:
                state.commit()

    train(state)

A numpy array given as an extra is synced and restored in place; any other extra (numbers,
strings, lists, dicts of them) is replaced by the committed or broadcast copy. ``State`` is the
base class for a state of your own (implement ``save``, ``restore`` and ``sync``).
"""
from __future__ import annotations

from .errors import MembershipChangedError, TooFewWorkersError
from .worker.elastic import ObjectState, State, StateHandler, run

__all__ = ["ObjectState", "State", "StateHandler", "run", "MembershipChangedError",
           "TooFewWorkersError"]
