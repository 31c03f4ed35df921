"""Property test: add_into equals numpy's add for arbitrary arrays, offsets and thread counts."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from byteps_like import _core

_DTYPES = {"float32": np.float32, "int64": np.int64, "float16": np.float16}


@st.composite
def _operands(draw):
    name = draw(st.sampled_from(sorted(_DTYPES)))
    dtype = np.dtype(_DTYPES[name])
    n = draw(st.integers(0, 300))
    elements = (st.floats(width=8 * dtype.itemsize, allow_nan=True, allow_infinity=True)
                if dtype.kind == "f" else st.integers(-(2**63), 2**63 - 1))
    a = draw(arrays(dtype, n, elements=elements))
    b = draw(arrays(dtype, n, elements=elements))
    return name, a, b, draw(st.integers(0, 7)), draw(st.sampled_from([1, 2]))


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(_operands())
def test_add_into_equals_numpy(operands):
    name, a, b, offset, nthreads = operands
    raw = bytearray(a.nbytes + offset)
    dst = np.frombuffer(raw, dtype=a.dtype, count=a.size, offset=offset)
    dst[...] = a
    _core.add_into(dst, b, name, nthreads)
    with np.errstate(all="ignore"):
        want = a + b
    if a.dtype.kind == "f":
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(dst), nan)
        uint = np.dtype(f"u{a.dtype.itemsize}")
        assert np.array_equal(dst.view(uint)[~nan], want.view(uint)[~nan])
    else:
        assert np.array_equal(dst, want)
