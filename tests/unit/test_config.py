"""Unit tests of byteps_like.config: parsing, precedence, validation, warnings and the docs."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import pathlib
import subprocess
import sys

import pytest

from byteps_like import config as C
from byteps_like.config import Config, load
from byteps_like.errors import BytePSError, ConfigError

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def env_load(**env: str) -> Config:
    return load(env=env)


# ------------------------------------------------------------------------------- defaults
def test_defaults_have_declared_values_and_python_types():
    cfg = load(env={})
    assert cfg == Config()
    c = cfg.cluster
    assert (c.role, c.num_worker, c.num_server, c.root_uri, c.root_port) == (
        "worker", 1, 0, "127.0.0.1", 9000)
    assert (c.worker_id, c.node_host, c.local_rank, c.local_size, c.server_port, c.job_id) == (
        None, "", 0, 1, 0, "default")
    assert cfg.partition.partition_bytes == 4096000
    assert (cfg.scheduling.credit, cfg.scheduling.queue_depth) == (4, 64)
    assert (cfg.server.engine_threads, cfg.server.enable_async, cfg.server.sum_threads) == (
        4, False, 1)
    assert (cfg.transport.tcp_connections, cfg.transport.max_message_bytes,
            cfg.transport.transport) == (1, 1 << 30, "zmq")
    t = cfg.timeouts
    assert (t.op_timeout, t.register_timeout, t.heartbeat_interval, t.heartbeat_timeout,
            t.shutdown_timeout) == (600.0, 120.0, 1.0, 20.0, 30.0)
    assert cfg.log.level == "WARNING"
    expected = {"int": int, "size": int, "seconds": float, "float": float, "bool": bool,
                "str": str, "choice": str, "cpulist": tuple}
    for s in C.SETTINGS:
        value = cfg.get(s.path)
        assert value is None or type(value) is expected[s.kind], s.path
        assert cfg.source(s.path) == "default"


def test_every_setting_has_help_and_unique_names():
    for s in C.SETTINGS:
        assert s.help.strip(), f"{s.path} has no help text"
    assert len({s.env for s in C.SETTINGS}) == len(C.SETTINGS)
    assert not C.IGNORED_NAMES & {s.env for s in C.SETTINGS}


def test_convenience_properties():
    cfg = env_load(DMLC_NUM_WORKER="2", BYTEPS_LOCAL_SIZE="4")
    assert cfg.cluster.total_workers == 8 and not cfg.cluster.is_standalone
    assert load(env={}).cluster.is_standalone
    assert not env_load(DMLC_NUM_SERVER="1").cluster.is_standalone


# ------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("text, expected", [
    ("4096000", 4096000), ("4K", 4096), ("4k", 4096), ("4KiB", 4096), ("4kb", 4000),
    ("4M", 4 << 20), ("4MiB", 4 << 20), ("4MB", 4_000_000), ("0.5G", 1 << 29),
    ("1GB", 1_000_000_000), ("1.5M", 1572864), (" 8 KiB ", 8192), ("2048B", 2048),
])
def test_size_parsing(text, expected):
    assert env_load(BYTEPS_PARTITION_BYTES=text).partition.partition_bytes == expected


@pytest.mark.parametrize("text", ["4x", "M", "4iB", "-4K", "1.0001K", "4 K B", "four"])
def test_size_errors(text):
    with pytest.raises(ConfigError) as info:
        env_load(BYTEPS_PARTITION_BYTES=text)
    assert str(info.value).startswith(f"BYTEPS_PARTITION_BYTES={text!r} (environment) ")


def test_size_error_message_is_exact():
    with pytest.raises(ConfigError, match=r"^BYTEPS_PARTITION_BYTES='4x' \(environment\) is not "
                       r"a size: use bytes or a suffix K, M, G \(powers of 1024\)"):
        env_load(BYTEPS_PARTITION_BYTES="4x")


@pytest.mark.parametrize("text, expected", [
    ("1", True), ("0", False), ("true", True), ("FALSE", False), ("Yes", True), ("no", False),
    ("on", True), ("OFF", False),
])
def test_bool_parsing(text, expected):
    assert env_load(BYTEPS_ENABLE_ASYNC=text).server.enable_async is expected


def test_bool_error():
    with pytest.raises(ConfigError, match=r"^BYTEPS_ENABLE_ASYNC='maybe' \(environment\) is not "
                       r"a boolean: use 1/0, true/false, yes/no or on/off$"):
        env_load(BYTEPS_ENABLE_ASYNC="maybe")


def test_int_parsing():
    assert env_load(DMLC_NUM_WORKER=" 3 ").cluster.num_worker == 3


@pytest.mark.parametrize("name,value,says", [
    ("DMLC_NUM_WORKER", "two", r"^DMLC_NUM_WORKER='two' \(environment\) is not an integer$"),
    ("DMLC_NUM_WORKER", "1.5", r"^DMLC_NUM_WORKER='1.5' \(environment\)"),
    ("DMLC_NUM_WORKER", "0", r"^DMLC_NUM_WORKER='0' \(environment\) must be >= 1$"),
    ("BYTEPS_TCP_CONNECTIONS", "17",
     r"^BYTEPS_TCP_CONNECTIONS='17' \(environment\) must be between 1 and 16$"),
    ("DMLC_PS_ROOT_PORT", "0", r"DMLC_PS_ROOT_PORT='0' .* between 1 and 65535"),
    ("BYTEPS_SCHEDULING_CREDIT", "-1", r"BYTEPS_SCHEDULING_CREDIT='-1' .* must be >= 0"),
])
def test_int_errors(name, value, says):
    with pytest.raises(ConfigError, match=says):
        env_load(**{name: value})


def test_int_fields_reject_bool_and_float_overrides():
    with pytest.raises(ConfigError, match=r"^DMLC_NUM_WORKER=True \(override\) is not an integer"):
        load(env={}, overrides={"cluster.num_worker": True})
    with pytest.raises(ConfigError, match=r"^DMLC_NUM_WORKER=2.0 \(override\)"):
        load(env={}, overrides={"cluster.num_worker": 2.0})


@pytest.mark.parametrize("text, expected", [
    ("600", 600.0), ("0.5", 0.5), ("250ms", 0.25), ("30s", 30.0), ("2m", 120.0), ("1h", 3600.0),
    ("1e3", 1000.0),
])
def test_seconds_parsing(text, expected):
    value = env_load(BYTEPS_TIMEOUT_SECONDS=text).timeouts.op_timeout
    assert value == expected and type(value) is float


@pytest.mark.parametrize("text, message", [
    ("abc", "is not a duration"), ("inf", "is not a duration"), ("nan", "is not a duration"),
    ("0", "must be a positive number of seconds"), ("-1", "must be a positive number"),
])
def test_seconds_errors(text, message):
    with pytest.raises(ConfigError, match=rf"^BYTEPS_TIMEOUT_SECONDS='{text}' \(environment\) "
                       + message):
        env_load(BYTEPS_TIMEOUT_SECONDS=text)


def test_choice_parsing_is_case_insensitive_and_normalized():
    assert env_load(BYTEPS_LOG_LEVEL="debug").log.level == "DEBUG"
    assert env_load(DMLC_ROLE="Server").cluster.role == "server"
    with pytest.raises(ConfigError, match=r"^BYTEPS_LOG_LEVEL='loud' \(environment\) is not one "
                       r"of TRACE, DEBUG, INFO, WARNING, ERROR, FATAL$"):
        env_load(BYTEPS_LOG_LEVEL="loud")
    with pytest.raises(ConfigError, match=r"BYTEPS_TRANSPORT='tcp' .* not one of zmq"):
        env_load(BYTEPS_TRANSPORT="tcp")


def test_str_fields():
    assert env_load(DMLC_PS_ROOT_URI=" 10.0.0.1 ").cluster.root_uri == "10.0.0.1"
    with pytest.raises(ConfigError, match=r"^DMLC_PS_ROOT_URI='' \(override\) must not be empty"):
        load(env={}, overrides={"DMLC_PS_ROOT_URI": ""})
    with pytest.raises(ConfigError, match=r"BYTEPS_JOB_ID=7 \(override\) is not a string"):
        load(env={}, overrides={"cluster.job_id": 7})


def test_float_kind_parser():
    parse = C._PARSERS["float"]
    assert parse("2.5") == 2.5 and parse(3) == 3.0
    for bad in ("x", "inf", True, None):
        with pytest.raises(C._Bad, match="is not a finite number"):
            parse(bad)


def test_empty_env_value_means_unset():
    cfg = env_load(DMLC_NUM_WORKER="", DMLC_WORKER_ID="", BYTEPS_LOG_LEVEL="  ")
    assert cfg == load(env={})


def test_optional_int():
    assert env_load(DMLC_NUM_WORKER="4", DMLC_WORKER_ID="3").cluster.worker_id == 3
    with pytest.raises(ConfigError, match=r"DMLC_WORKER_ID='-1' \(environment\) must be >= 0"):
        env_load(DMLC_WORKER_ID="-1")


# ------------------------------------------------------------------------------- precedence
def write(tmp_path, text: str) -> str:
    path = tmp_path / "bps.toml"
    path.write_text(text)
    return str(path)


def test_precedence_default_file_env_argv_override(tmp_path):
    path = write(tmp_path, "[cluster]\nnum_worker = 2\nnum_server = 3\nlocal_size = 4\n"
                           "root_port = 9100\n[partition]\npartition_bytes = '2M'\n")
    env = {"DMLC_NUM_SERVER": "5", "DMLC_PS_ROOT_PORT": "9200", "BYTEPS_LOCAL_SIZE": "6"}
    cfg = load(env=env, config_file=path, argv_overrides={"cluster.local_size": 7},
               overrides={"DMLC_PS_ROOT_PORT": 9300, "cluster.local_size": 8})
    assert cfg.cluster.num_worker == 2 and cfg.source("cluster.num_worker") == f"config file {path}"
    assert cfg.partition.partition_bytes == 2 << 20
    assert cfg.cluster.num_server == 5 and cfg.source("DMLC_NUM_SERVER") == "environment"
    assert cfg.cluster.root_port == 9300 and cfg.source("cluster.root_port") == "override"
    assert cfg.cluster.local_size == 8
    cfg = load(env=env, config_file=path, argv_overrides={"cluster.local_size": 7})
    assert cfg.cluster.local_size == 7 and cfg.source("cluster.local_size") == "command line"
    assert cfg.cluster.root_port == 9200
    assert cfg.cluster.job_id == "default" and cfg.source("cluster.job_id") == "default"


def test_argparse_namespace_none_means_not_given():
    ns = argparse.Namespace(**{"cluster.num_server": None, "DMLC_ROLE": "server"})
    cfg = load(env={"DMLC_NUM_SERVER": "2"}, argv_overrides=ns)
    assert cfg.cluster.num_server == 2 and cfg.cluster.role == "server"


def test_config_file_from_env_and_env_names_in_file(tmp_path):
    path = write(tmp_path, "DMLC_NUM_WORKER = 3\nBYTEPS_ENABLE_ASYNC = true\n"
                           "[timeouts]\nop_timeout = 5\n")
    cfg = load(env={"BYTEPS_CONFIG_FILE": path})
    assert (cfg.cluster.num_worker, cfg.server.enable_async) == (3, True)
    assert cfg.timeouts.op_timeout == 5.0 and type(cfg.timeouts.op_timeout) is float


def test_config_file_errors(tmp_path):
    path = write(tmp_path, "[cluster]\nnum_workers = 2\n")
    with pytest.raises(ConfigError, match=r"unknown setting 'cluster.num_workers' \(config file "
                       r".*\): did you mean cluster.num_worker\?"):
        load(env={}, config_file=path)
    path = write(tmp_path, "[partition]\npartition_bytes = '4x'\n")
    with pytest.raises(ConfigError, match=r"^BYTEPS_PARTITION_BYTES='4x' \(config file .*bps.toml\)"
                       r" is not a size"):
        load(env={}, config_file=path)
    with pytest.raises(ConfigError, match=r"config file .*missing.toml \(BYTEPS_CONFIG_FILE\) "
                       r"cannot be read"):
        load(env={"BYTEPS_CONFIG_FILE": str(tmp_path / "missing.toml")})
    path = write(tmp_path, "[cluster\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load(env={}, config_file=path)


def test_unknown_override_key_is_an_error():
    with pytest.raises(ConfigError, match=r"^unknown setting 'cluster.num_workers' \(override\): "
                       r"did you mean cluster.num_worker\?"):
        load(env={}, overrides={"cluster.num_workers": 2})


# ------------------------------------------------------------------------------- cross-field
# a setting out of the range another one sets: (environment, overrides, the error naming both,
# a pair of values just inside, and what it gives)
CROSS_FIELD = {
    "worker id": ({"DMLC_WORKER_ID": "2", "DMLC_NUM_WORKER": "2"}, {},
                  r"^DMLC_WORKER_ID=2 \(environment\) must be < DMLC_NUM_WORKER=2 \(environment\)",
                  {"DMLC_WORKER_ID": "1", "DMLC_NUM_WORKER": "2"}, ("cluster", "worker_id", 1)),
    "local rank": ({}, {"cluster.local_rank": 1},
                   r"^BYTEPS_LOCAL_RANK=1 \(override\) must be < BYTEPS_LOCAL_SIZE=1 \(default\)",
                   {"BYTEPS_LOCAL_RANK": "1", "BYTEPS_LOCAL_SIZE": "2"},
                   ("cluster", "local_rank", 1)),
    "message": ({"BYTEPS_MAX_MESSAGE_BYTES": "4M", "BYTEPS_PARTITION_BYTES": "4M"}, {},
                r"^BYTEPS_MAX_MESSAGE_BYTES=4194304 \(environment\) must be >= "
                r"BYTEPS_PARTITION_BYTES=4194304 \(environment\) \+ 4096",
                {"BYTEPS_MAX_MESSAGE_BYTES": str((4 << 20) + 4096), "BYTEPS_PARTITION_BYTES": "4M"},
                ("transport", "max_message_bytes", (4 << 20) + 4096)),
    "heartbeat": ({"BYTEPS_HEARTBEAT_TIMEOUT_SECONDS": "2"}, {},
                  r"^BYTEPS_HEARTBEAT_TIMEOUT_SECONDS=2.0 \(environment\) must exceed twice "
                  r"BYTEPS_HEARTBEAT_INTERVAL_SECONDS=1.0 \(default\)",
                  {"BYTEPS_HEARTBEAT_TIMEOUT_SECONDS": "2.5"},
                  ("timeouts", "heartbeat_timeout", 2.5)),
}


@pytest.mark.parametrize("case", sorted(CROSS_FIELD))
def test_a_setting_out_of_anothers_range_is_an_error_naming_both(case):
    env, overrides, says, inside, (section, name, value) = CROSS_FIELD[case]
    with pytest.raises(ConfigError, match=says):
        load(env=env, overrides=overrides)
    assert getattr(getattr(load(env=inside), section), name) == value


# ------------------------------------------------------------------------------- env names
def test_unknown_names_are_kept_for_one_report_with_suggestions(caplog):
    """No warnings.warn (issue 30: every process printed it, with a Python source line): the
    names are kept on the Config, and the process's entry point logs one line (bpslaunch once
    for the processes it starts, BYTEPS_REPORT_UNKNOWN_SETTINGS=0 for them)."""
    cfg = env_load(BYTEPS_PARTITON_BYTES="4M", DMLC_NUM_WORKER="2")  # -W error: no warning
    assert cfg.unknown_settings == (
        "BYTEPS_PARTITON_BYTES (did you mean BYTEPS_PARTITION_BYTES?)",)
    assert cfg.partition.partition_bytes == 4096000 and cfg.cluster.num_worker == 2
    assert env_load(BYTEPS_ZZZ_QQQ="1").unknown_settings == (
        "BYTEPS_ZZZ_QQQ (not a byteps_like setting)",)
    with caplog.at_level(logging.WARNING, logger="byteps_like.config"):
        assert C.report_unknown_settings(cfg)
        assert not C.report_unknown_settings(env_load(BYTEPS_PARTITON_BYTES="4M",
                                                      BYTEPS_REPORT_UNKNOWN_SETTINGS="0"))
        assert not C.report_unknown_settings(load(env={}))
    assert [r.getMessage() for r in caplog.records] == [
        "unknown environment variable(s) ignored: BYTEPS_PARTITON_BYTES (did you mean "
        "BYTEPS_PARTITION_BYTES?); `python -m byteps_like.config --describe` lists the settings"]
    # a misspelt name is a likely cause of a later error: the error says it
    with pytest.raises(ConfigError, match=r"^DMLC_WORKER_ID=1 \(environment\) must be < "
                       r"DMLC_NUM_WORKER=1 \(default\); unknown environment variable\(s\) "
                       r"ignored: DMLC_NUM_WORKERS \(did you mean DMLC_NUM_WORKER\?\)"):
        env_load(DMLC_NUM_WORKERS="2", DMLC_WORKER_ID="1")


def test_other_prefixes_are_not_inspected():
    assert env_load(PATH="/bin", PS_VERBOSE="2", CUDA_VISIBLE_DEVICES="0") == load(env={})


def test_ignored_byteps_names_do_not_warn(caplog):
    env = {name: "1" for name in C.IGNORED_NAMES}
    env["BYTEPS_CONFIG_FILE"] = ""
    with caplog.at_level(logging.DEBUG, logger="byteps_like.config"):
        assert load(env=env) == load(env={})  # -W error: a warning would fail this test
    assert "BYTEPS_ENABLE_IPC" in caplog.text  # BYTEPS_TRACE_* are real settings now
    # DMLC_ENABLE_RDMA / DMLC_ENABLE_UCX are settings now: they select BYTEPS_TRANSPORT=ucx
    for name in ("DMLC_INTERFACE",
                 "BYTEPS_NCCL_GROUP_SIZE", "BYTEPS_PCIE_SWITCH_SIZE", "BYTEPS_NUMA_DEFAULT_QUOTA"):
        assert name in C.IGNORED_NAMES
    # BYTEPS_FORCE_DISTRIBUTED is a setting now: one worker machine skips the servers without it
    assert "BYTEPS_FORCE_DISTRIBUTED" not in C.IGNORED_NAMES
    assert load(env={"BYTEPS_FORCE_DISTRIBUTED": "1"}).cluster.force_distributed
    assert load(env={"DMLC_NUM_WORKER": "1"}).cluster.single_machine
    assert not load(env={"DMLC_NUM_WORKER": "1", "BYTEPS_FORCE_DISTRIBUTED": "1"}).cluster.single_machine
    assert not load(env={"DMLC_NUM_WORKER": "2"}).cluster.single_machine


def test_env_none_reads_os_environ(monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith(("BYTEPS_", "DMLC_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("DMLC_NUM_SERVER", "3")
    assert load().cluster.num_server == 3


# ------------------------------------------------------------------------------- the object
def test_to_env_round_trip():
    assert load(env={}).to_env() == {}
    cfg = load(env={}, overrides={
        "cluster.role": "server", "cluster.num_worker": 3, "cluster.worker_id": 2,
        "cluster.node_host": "h1", "cluster.local_size": 2, "cluster.local_rank": 1,
        "partition.partition_bytes": "1M", "server.enable_async": True,
        "timeouts.heartbeat_interval": 0.1, "timeouts.op_timeout": "1.5", "log.level": "info"})
    env = cfg.to_env()
    assert env["BYTEPS_ENABLE_ASYNC"] == "1" and env["BYTEPS_PARTITION_BYTES"] == "1048576"
    assert env["BYTEPS_HEARTBEAT_INTERVAL_SECONDS"] == "0.1"
    assert "DMLC_PS_ROOT_URI" not in env
    assert all(isinstance(v, str) for v in env.values())
    assert load(env=env) == cfg
    full = cfg.to_env(include_defaults=True)
    assert full["DMLC_PS_ROOT_URI"] == "127.0.0.1" and load(env=full) == cfg


def test_frozen():
    cfg = load(env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cluster.num_worker = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cluster = cfg.cluster  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg._sources["cluster.num_worker"] = "x"  # type: ignore[index]
    assert hash(cfg) == hash(load(env={}))


def test_replace_validates_and_keeps_sources():
    cfg = env_load(DMLC_NUM_WORKER="2")
    new = cfg.replace(**{"cluster.worker_id": 1}, BYTEPS_LOG_LEVEL="error")
    assert (new.cluster.worker_id, new.log.level, new.cluster.num_worker) == (1, "ERROR", 2)
    assert new.source("cluster.num_worker") == "environment"
    assert new.source("cluster.worker_id") == "override"
    assert cfg.cluster.worker_id is None
    assert new.replace(**{"cluster.worker_id": None}).cluster.worker_id is None
    with pytest.raises(ConfigError, match=r"DMLC_WORKER_ID=2 \(override\) must be < "
                       r"DMLC_NUM_WORKER=2 \(environment\)"):
        cfg.replace(DMLC_WORKER_ID=2)
    with pytest.raises(ConfigError, match=r"DMLC_NUM_WORKER=None \(override\) must be set"):
        cfg.replace(DMLC_NUM_WORKER=None)
    with pytest.raises(ConfigError, match="unknown setting 'nope'"):
        cfg.replace(nope=1)


def test_config_error_is_a_byteps_and_value_error():
    with pytest.raises(BytePSError):
        env_load(DMLC_ROLE="x")
    with pytest.raises(ValueError):
        env_load(DMLC_ROLE="x")


# ------------------------------------------------------------------------------- docs and CLI
def test_describe_rows_cover_every_setting():
    rows = C.describe_rows()
    assert [r.env for r in rows] == [s.env for s in C.SETTINGS]
    by_env = {r.env: r for r in rows}
    assert by_env["BYTEPS_PARTITION_BYTES"].unit == "bytes"
    assert by_env["BYTEPS_MAX_MESSAGE_BYTES"].default == "`1073741824` (1 GiB)"
    assert by_env["DMLC_WORKER_ID"].default == "unset"
    assert all(r.help for r in rows)


def test_docs_file_is_up_to_date():
    assert DOCS.exists() and DOCS.read_text() == C.render_markdown(), (
        "docs/configuration.md is stale; regenerate it with: "
        "python -m byteps_like.config --markdown > docs/configuration.md")


def test_cli_describe_and_show():
    out = subprocess.run([sys.executable, "-m", "byteps_like.config", "--describe"],
                         capture_output=True, text=True, check=True).stdout
    assert out == C.describe_markdown() and "| `DMLC_ROLE` |" in out
    env = {"DMLC_NUM_SERVER": "2", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-W", "error", "-m", "byteps_like.config", "--show"],
                          capture_output=True, text=True, check=True, env=env)
    assert "cluster.num_server" in proc.stdout and "DMLC_NUM_SERVER, environment" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "byteps_like.config", "--show"],
                          capture_output=True, text=True, env={**env, "DMLC_NUM_SERVER": "x"})
    assert proc.returncode == 2 and "DMLC_NUM_SERVER='x' (environment)" in proc.stderr
