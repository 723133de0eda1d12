# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""deploy/scripts: the commands serve_pd.sh and run_sweep.sh would run (DRY_RUN), checked by kvpush's own parsers; cleanup.sh for real."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import time
import types
from pathlib import Path

import pytest

from kvpush.connector.config import ConnectorConfig
from kvpush.services.router.config import RouterConfig

SCRIPTS = Path(__file__).resolve().parents[2] / "deploy" / "scripts"
CONNECTORS = {"push": "KvpushConnector", "pull": "NixlConnector", "upstream-push": "NixlPushConnector"}


def script(name: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVPUSH_", "ROLE", "MODE"))}
    return subprocess.run([str(SCRIPTS / name), *args], env={**clean, **env}, capture_output=True, text=True, timeout=60)


def test_scripts_are_valid_bash():
    for path in SCRIPTS.glob("*.sh"):
        subprocess.run(["bash", "-n", str(path)], check=True)
        assert os.access(path, os.X_OK), path


def test_serve_pd_turns_prefix_caching_on_when_asked_and_refuses_other_values(tmp_path):
    token = tmp_path / "token"
    token.write_text("t")
    env = {"DRY_RUN": "1", "ROLE": "decode", "MODE": "push", "CONTROL_PLANE": "10.0.0.2:50051", "KVPUSH_TOKEN_FILE": str(token)}
    on = script("serve_pd.sh", {**env, "PREFIX_CACHING": "on"})
    assert on.returncode == 0 and "--enable-prefix-caching" in shlex.split(on.stdout), on.stderr
    bad = script("serve_pd.sh", {**env, "PREFIX_CACHING": "yes"})
    assert bad.returncode == 2 and "PREFIX_CACHING must be off or on" in bad.stderr


def test_serve_pd_runs_a_pipeline_parallel_prefill_engine_and_refuses_a_pipeline_parallel_decode_engine(tmp_path):
    token = tmp_path / "token"
    token.write_text("t")
    env = {"DRY_RUN": "1", "MODE": "push", "CONTROL_PLANE": "10.0.0.2:50051", "KVPUSH_TOKEN_FILE": str(token), "PP_SIZE": "2"}
    prefill = script("serve_pd.sh", {**env, "ROLE": "prefill"})
    argv = shlex.split(prefill.stdout)
    assert prefill.returncode == 0 and argv[argv.index("--pipeline-parallel-size") + 1] == "2", prefill.stderr
    decode = script("serve_pd.sh", {**env, "ROLE": "decode"})
    assert decode.returncode == 2 and "decode engines of pipeline-parallel size 1" in decode.stderr


@pytest.mark.parametrize("mode", sorted(CONNECTORS))
@pytest.mark.parametrize(("role", "kv_role", "port"), [("prefill", "kv_producer", "8100"), ("decode", "kv_consumer", "8200")])
def test_serve_pd_builds_the_engine_command(tmp_path, mode, role, kv_role, port):
    token = tmp_path / "token"
    token.write_text("t")
    env = {"DRY_RUN": "1", "ROLE": role, "MODE": mode, "CONTROL_PLANE": "10.0.0.2:50051", "KVPUSH_TOKEN_FILE": str(token), "NIXL_BACKENDS": "LIBFABRIC"}
    result = script("serve_pd.sh", env)
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout)
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen3-32B"]
    assert argv[argv.index("--port") + 1] == port and "--no-enable-prefix-caching" in argv  # the benchmark's default
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert (config["kv_connector"], config["kv_role"]) == (CONNECTORS[mode], kv_role)
    assert config["kv_connector_extra_config"]["backends"] == ["LIBFABRIC"]
    if mode == "push":
        parsed = ConnectorConfig.from_kv_transfer_config(types.SimpleNamespace(**config))
        assert (parsed.role, parsed.control_plane, parsed.token, parsed.backends) == (role, "10.0.0.2:50051", "t", ("LIBFABRIC",))


@pytest.mark.parametrize(("env", "message"), [
    ({"ROLE": "prefill", "MODE": "push"}, "needs CONTROL_PLANE"),
    ({"ROLE": "router", "MODE": "pull"}, "ROLE must be prefill or decode"),
    ({"ROLE": "decode", "MODE": "teleport"}, "MODE must be"),
])
def test_serve_pd_refuses_bad_settings(env, message):
    result = script("serve_pd.sh", {"DRY_RUN": "1", **env})
    assert result.returncode == 2 and message in result.stderr


@pytest.mark.parametrize("mode", sorted(CONNECTORS))
def test_run_sweep_starts_a_router_kvpush_accepts_and_names_results_like_the_seed(tmp_path, mode):
    env = {"DRY_RUN": "1", "MODE": mode, "CONTROL_PLANE": "10.0.0.2:50051", "KVPUSH_TOKEN_FILE": str(tmp_path / "token"),
           "QPS_LIST": "1 4", "INPUT_LENS": "1024", "OUTPUT_LENS": "128", "ITERATIONS": "2", "RESULTS_DIR": str(tmp_path / "results")}
    result = script("run_sweep.sh", env)
    assert result.returncode == 0, result.stderr
    router, *bench = [shlex.split(line) for line in result.stdout.splitlines()]
    assert router[:2] == ["kvpush", "router"]
    parser = argparse.ArgumentParser()
    RouterConfig.add_arguments(parser)
    (tmp_path / "token").write_text("t")
    config = RouterConfig.from_args(parser.parse_args(router[2:]))
    assert config.mode == mode and [e.engine_id for e in config.prefill + config.decode] == ["prefill-engine-001", "decode-engine-001"]
    names = [argv[argv.index("--result-filename") + 1] for argv in bench]
    assert names == [f"{mode}_qps{q}_in1024_out128_iter{i}.json" for q in (1, 4) for i in (1, 2)]
    assert all(argv[:3] == ["vllm", "bench", "serve"] and argv[argv.index("--base-url") + 1] == "http://127.0.0.1:8000" for argv in bench)


def test_cleanup_stops_the_recorded_server_process_group(tmp_path):
    server = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        (tmp_path / "serve_prefill.pid").write_text(f"{server.pid}\n")
        result = script("cleanup.sh", {"PID_DIR": str(tmp_path), "GRACE_S": "5"}, "server")
        assert result.returncode == 0, result.stderr
        assert server.wait(timeout=10) == -signal.SIGTERM
        assert not (tmp_path / "serve_prefill.pid").exists()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_cleanup_ignores_stale_pid_files_and_needs_a_target(tmp_path):
    finished = subprocess.Popen(["true"])
    finished.wait()
    (tmp_path / "router.pid").write_text(f"{finished.pid}\n")
    started = time.monotonic()
    assert script("cleanup.sh", {"PID_DIR": str(tmp_path)}, "proxy").returncode == 0
    assert time.monotonic() - started < 5 and not (tmp_path / "router.pid").exists()
    assert script("cleanup.sh", {"PID_DIR": str(tmp_path)}).returncode == 2
