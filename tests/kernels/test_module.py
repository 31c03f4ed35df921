"""Argument checking, metadata and process/thread behaviour of byteps_like._core."""
from __future__ import annotations

import os
import time
import warnings

import numpy as np
import pytest

from byteps_like import _core

VALID = "float32, float64, float16, bfloat16, int32, int64"


def test_itemsize_and_dtypes():
    assert _core.DTYPES == ("float32", "float64", "float16", "bfloat16", "int32", "int64")
    assert [_core.itemsize(d) for d in _core.DTYPES] == [4, 8, 2, 2, 4, 8]
    with pytest.raises(ValueError, match=f"itemsize: unknown dtype 'uint8'; expected one of: {VALID}"):
        _core.itemsize("uint8")


def test_cpu_features():
    f = _core.cpu_features()
    for key in ("avx2", "f16c", "avx512f", "avx512bw", "fma"):
        assert isinstance(f[key], bool)
    assert f["detected_isa"] in ("scalar", "avx2", "avx512")
    assert f["isa"] == f["detected_isa"]
    assert f["kernel_fp16"] in ("scalar", "f16c-avx2", "f16c-avx512")
    if f["avx2"] and f["f16c"] and f["fma"]:
        assert f["kernel_fp16"].startswith("f16c")


def test_set_isa_hook():
    detected = _core.cpu_features()["detected_isa"]
    assert _core._set_isa("scalar") == detected
    try:
        f = _core.cpu_features()
        assert f["isa"] == "scalar" and f["kernel_fp16"] == "scalar"
    finally:
        assert _core._set_isa("auto") == "scalar"
    assert _core.cpu_features()["isa"] == detected
    with pytest.raises(ValueError, match="_set_isa: unknown level 'sse9'"):
        _core._set_isa("sse9")


def test_add_into_length_errors():
    f32 = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match=r"add_into: dst has 16 bytes and src has 12 bytes; they "
                                         r"must be equal and a multiple of the float32 itemsize \(4\)"):
        _core.add_into(f32, np.zeros(3, np.float32), "float32")
    with pytest.raises(ValueError, match=r"add_into: dst has 6 bytes and src has 6 bytes; .* "
                                         r"multiple of the int64 itemsize \(8\)"):
        _core.add_into(bytearray(6), bytes(6), "int64")
    with pytest.raises(ValueError, match=r"copy_into: dst has 3 bytes and src has 4 bytes"):
        _core.copy_into(bytearray(3), b"abcd")


def test_add_into_dtype_errors():
    f32 = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match=f"add_into: unknown dtype 'float8'; expected one of: {VALID}"):
        _core.add_into(f32, f32.copy(), "float8")
    with pytest.raises(TypeError):
        _core.add_into(f32, f32.copy(), np.float32)  # a dtype is named by a str


def test_buffer_errors():
    f32 = np.zeros(4, np.float32)
    readonly = np.zeros(4, np.float32)
    readonly.flags.writeable = False
    for dst in (bytes(16), readonly, memoryview(bytearray(16)).toreadonly()):
        with pytest.raises(ValueError, match="add_into: dst is read-only"):
            _core.add_into(dst, f32, "float32")
    with pytest.raises(ValueError, match="copy_into: dst is read-only"):
        _core.copy_into(bytes(16), f32)
    with pytest.raises(TypeError, match="add_into: src must support the buffer protocol"):
        _core.add_into(f32, [0.0] * 4, "float32")
    with pytest.raises(ValueError, match="add_into: dst must be a C-contiguous buffer"):
        _core.add_into(np.zeros(8, np.float32)[::2], f32, "float32")
    with pytest.raises(ValueError, match="add_into: src must be a C-contiguous buffer"):
        _core.add_into(f32, np.zeros((4, 2), np.float32).T[0], "float32")
    np.testing.assert_array_equal(f32, 0)  # nothing was written by a failed call


@pytest.mark.parametrize("nthreads", [-5, 0, 1, 3, 1000])
def test_any_nthreads_value_is_accepted(nthreads):
    a = np.ones((1 << 20) + 1, np.float32)
    _core.add_into(a, a.copy(), "float32", nthreads)
    assert (a == 2).all()


def test_fork_after_threaded_use():
    """A forked child gets a fresh thread pool instead of deadlocking on the parent's."""
    n = (1 << 20) + 9
    a = np.ones(n, np.float32)
    _core.add_into(a, a.copy(), "float32", nthreads=2)  # starts the pool in the parent
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
        pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            b = np.ones(n, np.float32)
            _core.add_into(b, b.copy(), "float32", nthreads=2)
            code = 0 if (b == 2).all() else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("child hung in a threaded add_into after fork")
        time.sleep(0.01)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
