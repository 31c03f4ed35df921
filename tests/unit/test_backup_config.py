"""Backup workers' setting (BYTEPS_BACKUP_WORKERS; docs/reliability.md, "Backup workers"): what
it is refused with, and what the workers declare (nothing new with b=0)."""
from __future__ import annotations

import pytest

from byteps_like.config import load
from byteps_like.errors import ConfigError
from byteps_like.worker.tensors import TensorState, backs_up, decl_bytes, declaration

JOB = {"DMLC_NUM_WORKER": "3", "DMLC_NUM_SERVER": "1", "BYTEPS_BACKUP_WORKERS": "1"}


def test_a_valid_job_loads_and_b_travels_only_with_averages():
    cfg = load(env=JOB)
    assert cfg.server.backup_workers == 1 and cfg.server.backup_max_lag == 64
    assert backs_up(cfg, True, 3) == 1
    assert backs_up(cfg, False, 3) == 0  # sums, broadcasts, allgathers wait for everyone
    assert backs_up(cfg, True, 1) == 0
    assert backs_up(load(env={**JOB, "BYTEPS_BACKUP_WORKERS": "0"}), True, 3) == 0


@pytest.mark.parametrize("extra,words", [
    ({"BYTEPS_BACKUP_WORKERS": "3"}, "must be below DMLC_NUM_WORKER"),
    ({"BYTEPS_ENABLE_ASYNC": "1"}, "BYTEPS_ENABLE_ASYNC"),
    ({"BYTEPS_ELASTIC": "1"}, "BYTEPS_ELASTIC"),
    ({"BYTEPS_COMPRESSOR": "onebit"}, "BYTEPS_COMPRESSOR"),
    ({"DMLC_NUM_SERVER": "2"}, "set BYTEPS_SERVER_FAILOVER=0"),
])
def test_what_it_cannot_serve_is_refused_naming_the_settings(extra, words):
    with pytest.raises(ConfigError) as exc:
        load(env={**JOB, **extra})
    assert "BYTEPS_BACKUP_WORKERS=1" in str(exc.value) or "BYTEPS_BACKUP_WORKERS=3" in str(
        exc.value), exc.value
    assert words in str(exc.value), exc.value


def test_two_servers_without_failover_are_fine():
    cfg = load(env={**JOB, "DMLC_NUM_SERVER": "2", "BYTEPS_SERVER_FAILOVER": "0"})
    assert cfg.server.backup_workers == 1


def test_b0_declares_the_bytes_it_always_did_and_b_travels_in_the_declaration():
    from byteps_like.wire import pack_decl, parse_decl
    st = TensorState(decl_id=0, name="w", shape=(3, 4), dtype="float32", nbytes=48,
                     parts=[(0, 48, 0, 0)])
    plain = pack_decl("w", [3, 4], "float32", 0, 1, 12)
    assert decl_bytes(declaration(st, "float32", 0)) == plain
    assert decl_bytes(declaration(st, "float32", 0, 0)) == plain
    two = decl_bytes(declaration(st, "float32", 0, 2))
    assert parse_decl(two).backup == 2 and parse_decl(plain).backup == 0
    assert parse_decl(two) == parse_decl(plain).__class__(
        **{**parse_decl(plain).__dict__, "backup": 2})


def test_bpslaunch_backup_workers_sets_every_process_and_is_checked_at_launch():
    from byteps_like.launcher.cli import parse_args, plan_launch
    env = {"PATH": "/usr/bin:/bin", "BYTEPS_SERVER_FAILOVER": "0"}
    launch = plan_launch(*parse_args(["--local", "--workers", "3", "--servers", "1",
                                      "--no-bind", "--backup-workers", "1", "--", "true"]),
                         env)
    assert launch.base_env["BYTEPS_BACKUP_WORKERS"] == "1"
    with pytest.raises(ConfigError, match="must be below DMLC_NUM_WORKER"):
        plan_launch(*parse_args(["--local", "--workers", "2", "--servers", "1", "--no-bind",
                                 "--backup-workers", "2", "--", "true"]), env)
