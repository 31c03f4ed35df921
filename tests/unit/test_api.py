"""The framework-neutral numpy API's argument checks (no job needed)."""
from __future__ import annotations

import numpy as np
import pytest

import byteps_like as bps


@pytest.mark.parametrize("call", [bps.push_pull, bps.push_pull_async])
@pytest.mark.parametrize("name", [False, True, 3, b"w"])
def test_push_pull_refuses_a_name_that_is_not_a_str(call, name):
    # BytePS's habit push_pull(tensor, average) would name the tensor False and average it
    with pytest.raises(TypeError, match=r"name must be a str.*push_pull\(array, name=None, "
                                        r"average=True"):
        call(np.ones(3, np.float32), name)


@pytest.mark.parametrize("op", ["Adasum", "Min", "Max", "Product"])
def test_horovods_other_reductions_exist_and_are_refused_naming_the_op(op):
    """Issue 40: ``hvd.Adasum`` in a Horovod script is the documented ValueError naming the op
    where it is passed, not an AttributeError where it is named."""
    from byteps_like import reduce_op
    from byteps_like.reduce_op import resolve_average
    value = getattr(reduce_op, op)
    assert int(value) == {"Adasum": 2, "Min": 3, "Max": 4, "Product": 5}[op]  # Horovod's
    with pytest.raises(ValueError, match=rf"allreduce: op={op} is not supported: byteps_like "
                                         "reduces with Average or Sum only"):
        resolve_average(value, None, "allreduce")
    import byteps_like.torch as hvd
    assert getattr(hvd, op) is value and op in hvd.__all__


def test_the_abort_notice_states_an_exception_in_one_line():
    """Issue 40: every node logs a worker's abort notice: one line, the exception that says
    what happened (TensorFlow wraps a byteps_like error in 'UnknownError: Graph execution
    error:' and a page of graph trace)."""
    from byteps_like.worker.membership import brief_exception
    assert brief_exception(RuntimeError, RuntimeError("boom")) == "RuntimeError: boom"
    wrapped = ("Graph execution error:\n\nDetected at node EagerPyFunc defined at:\n  File "
               "\"train.py\", line 13, in <module>\n\nPeerLeftError: push_pull of 'w': worker "
               "rank 1 has finished without join()\nTraceback (most recent call last):\n  File "
               "\"x.py\", line 1\n\nbyteps_like.errors.PeerLeftError: push_pull of 'w': worker "
               "rank 1 has finished (its script ended without join()); call join()\n\n\t "
               "[[{{node EagerPyFunc}}]] [Op:__inference_multi_step]")
    assert brief_exception(ValueError, ValueError(wrapped)) == (
        "byteps_like.errors.PeerLeftError: push_pull of 'w': worker rank 1 has finished (its "
        "script ended without join()); call join()")
    assert brief_exception(ValueError, ValueError("first line\nsecond")) == "ValueError: first line"
