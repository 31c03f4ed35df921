"""BYTEPS_TRANSPORT=ucx and the native data plane's UCX streams: what a job does where _core
cannot load UCX (a clear ConfigError with BYTEPS_DATA_PLANE=native, a logged fall-back to the
ucxx engine with auto), and what _core reports about it."""
from __future__ import annotations

import logging

import pytest

from byteps_like import _core
from byteps_like.config import load
from byteps_like.errors import ConfigError
from byteps_like.transport import native, ucx_native

from ..native_stream import ucx_skip_reason


@pytest.fixture
def no_ucx(monkeypatch):
    monkeypatch.setattr(ucx_native, "_why", "built without UCX's headers (test)")
    monkeypatch.setattr(native, "_fallback_logged", False)


def test_without_ucx_streams_native_refuses_and_auto_falls_back_with_a_warning(no_ucx, caplog):
    with pytest.raises(ConfigError, match="BYTEPS_DATA_PLANE=native cannot serve this job: "
                                          "BYTEPS_TRANSPORT=ucx but the native plane's UCX "
                                          r"streams are unavailable: built without"):
        native.native_enabled(load(env={"BYTEPS_TRANSPORT": "ucx",
                                        "BYTEPS_DATA_PLANE": "native"}))
    with caplog.at_level(logging.WARNING, logger="byteps_like.native"):
        assert not native.native_enabled(load(env={"BYTEPS_TRANSPORT": "ucx"}))
    (rec,) = caplog.records
    assert "the native data plane is off" in rec.getMessage()
    assert "ucxx engine" in rec.getMessage()
    assert native.native_enabled(load(env={}))   # TCP streams need no UCX


def test_device_memory_keeps_the_ucxx_engine():
    cfg = load(env={"BYTEPS_TRANSPORT": "ucx", "BYTEPS_UCX_DEVICE_MEMORY": "1"})
    assert any("BYTEPS_UCX_DEVICE_MEMORY" in w for w in native.native_reasons(cfg))


def test_core_says_whether_ucx_streams_are_usable(monkeypatch):
    why = ucx_skip_reason(monkeypatch)
    assert why == _core.ucx_unavailable()
    if not _core.ucx_built():
        assert "built without UCX's headers" in why
    elif ucx_native.libucp_path() is not None:
        assert why == "", why   # the wheel is there and _core was built against it
