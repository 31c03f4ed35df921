"""BYTEPS_TRANSPORT=ucx and the native data plane's UCX streams: what a job does where _core
cannot load UCX (a ConfigError at start naming what to install: the ucxx engine it fell back
to is retired), and what _core reports about it."""
from __future__ import annotations

import importlib.util

import pytest

from byteps_like import _core
from byteps_like.config import load
from byteps_like.errors import ConfigError
from byteps_like.transport import native, ucx_native

from ..native_stream import UCX_EXTRA, ucx_skip_reason


@pytest.fixture
def no_ucx(monkeypatch):
    monkeypatch.setattr(ucx_native, "_why", "built without UCX's headers (test)")


@pytest.mark.parametrize("plane", ["auto", "native"])
def test_without_ucx_streams_a_ucx_job_refuses_to_start_naming_what_to_install(no_ucx, plane):
    with pytest.raises(ConfigError, match=r"BYTEPS_TRANSPORT=ucx: the native data plane's UCX "
                                          r"streams are unavailable \(built without UCX's "
                                          r"headers \(test\)\); install byteps_like\[ucx\]"):
        native.check(load(env={"BYTEPS_TRANSPORT": "ucx", "BYTEPS_DATA_PLANE": plane}))
    native.check(load(env={}))   # TCP streams need no UCX


def test_device_memory_is_retired_naming_the_replacement():
    with pytest.raises(ConfigError, match=r"BYTEPS_UCX_DEVICE_MEMORY=True \(environment\) is "
                                          "retired: CUDA buffers are staged through pinned host "
                                          "memory"):
        load(env={"BYTEPS_TRANSPORT": "ucx", "BYTEPS_UCX_DEVICE_MEMORY": "1"})


def test_the_zmq_data_plane_is_retired_naming_the_replacement():
    with pytest.raises(ConfigError) as err:
        load(env={"BYTEPS_DATA_PLANE": "zmq"})
    text = str(err.value)
    assert text.startswith("BYTEPS_DATA_PLANE='zmq' (environment) is retired: worker-server data "
                           "always moves on the native data plane"), text
    assert "authenticated with the job's secret" in text and "not encrypted" in text, text
    assert "WireGuard" in text and "control plane stays CURVE-encrypted" in text, text


def test_core_says_whether_ucx_streams_are_usable(monkeypatch):
    why = ucx_skip_reason(monkeypatch)
    assert why == _core.ucx_unavailable()
    if not _core.ucx_built():
        assert "built without UCX's headers" in why
    elif ucx_native.libucp_path() is not None:
        assert why == "", why   # the wheel is there and _core was built against it


def test_an_environment_with_the_ucx_extra_has_a_core_built_with_ucx():
    """scripts/setup.sh installs the `ucx` extra into .venv and builds _core against its
    headers; an environment with the extra and a _core without UCX (built before the extra
    arrived, or another environment's build) fails here rather than skipping the UCX tests."""
    if importlib.util.find_spec("libucx") is not None:
        assert _core.ucx_built(), (f"{UCX_EXTRA}, but {_core.__file__} was built without "
                                   "UCX's headers: build again here, `pip install --no-deps -e .`")
        assert ucx_native.libucp_path() is not None
    else:   # an environment without the extra (.venv-mxnet): UCX jobs say what to install
        with pytest.raises(ConfigError, match=r"install byteps_like\[ucx\]"):
            native.check(load(env={"BYTEPS_TRANSPORT": "ucx"}))
