"""Settings that name a compressor are checked when the job starts (issue 41, item 8):
``BYTEPS_COMPRESSOR=pickle`` was accepted at start and failed only when an optimizer resolved
it. Now config.load refuses it (so bpslaunch exits 2 before starting anything, and a worker's
init fails at once) naming the setting, the value and the valid names. The transport settings
(BYTEPS_TRANSPORT, BYTEPS_DATA_PLANE) were choices checked at load already."""
from __future__ import annotations

import pytest

from byteps_like import compression
from byteps_like.config import BUILTIN_COMPRESSORS, load
from byteps_like.errors import ConfigError
from byteps_like.launcher.cli import main

from .test_launcher import _clean_env


@pytest.mark.parametrize("value,hint", [("pickle", ""), ("onebti", "did you mean 'onebit'?"),
                                        ("ef", ""), ("topk(0.1)", "")])
def test_an_unknown_compressor_is_a_config_error_at_load(value, hint):
    with pytest.raises(ConfigError) as ei:
        load(env={"BYTEPS_COMPRESSOR": value})
    msg = str(ei.value)
    assert f"BYTEPS_COMPRESSOR={value!r} (environment) is not a compressor" in msg, msg
    assert hint in msg and "registered:NAME" in msg, msg
    assert all(name in msg for name in BUILTIN_COMPRESSORS), msg


def test_every_name_load_accepts_is_one_the_compressors_resolve():
    """config.BUILTIN_COMPRESSORS (config.py may not import compression) against the registry."""
    for name in BUILTIN_COMPRESSORS:
        comp = compression.resolve(None, load(env={"BYTEPS_COMPRESSOR": name}))
        assert isinstance(comp, compression.Compressor), name
    assert set(BUILTIN_COMPRESSORS) <= set(compression.registered())


def test_a_registered_compressor_is_named_registered_name():
    cfg = load(env={"BYTEPS_COMPRESSOR": "registered:mine_early"})  # not registered yet: fine
    with pytest.raises(compression.CompressionError, match="no compressor is registered as "
                                                           "'mine_early'"):
        compression.resolve(None, cfg)
    compression.register("mine_early", lambda: compression.Compression.fp16)
    try:
        assert compression.resolve(None, cfg) is compression.Compression.fp16
    finally:
        compression.unregister("mine_early")
    with pytest.raises(ConfigError, match="after 'registered:' comes the name"):
        load(env={"BYTEPS_COMPRESSOR": "registered:"})


@pytest.mark.parametrize("name,k,ok", [("topk", "0.01", True), ("topk", "37", True),
                                       ("randomk", "2.5", False), ("topk", "0", False),
                                       ("onebit", "2.5", True)])
def test_the_k_of_a_sparse_compressor_is_checked_at_load(name, k, ok):
    env = {"BYTEPS_COMPRESSOR": name, "BYTEPS_COMPRESSOR_K": k}
    if ok:
        load(env=env)
        return
    with pytest.raises(ConfigError, match=f"BYTEPS_COMPRESSOR_K={float(k)!r}.*does not suit"):
        load(env=env)


@pytest.mark.parametrize("name,value", [("BYTEPS_COMPRESSOR", "pickle"),
                                        ("BYTEPS_TRANSPORT", "carrier-pigeon"),
                                        ("BYTEPS_DATA_PLANE", "pickle")])
def test_bpslaunch_refuses_a_bad_name_before_starting_anything(capsys, name, value):
    assert main(["--local", "--", "python", "x.py"], environ=_clean_env(**{name: value})) == 2
    err = capsys.readouterr().err
    assert f"{name}={value!r}" in err, err
