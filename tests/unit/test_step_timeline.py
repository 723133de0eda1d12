# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""bench.step_timeline: an engine step's parts from the engine core's and the worker's timeline files."""

from __future__ import annotations

import json

import pytest

from bench.step_timeline import engine_processes, forward_steps, main

GROUP = 4242


def write(folder, pid, lines):
    (folder / f"{GROUP}-{pid}.log").write_text("".join(f"{part} {start:.6f} {end:.6f}\n" for part, start, end in lines))


def one_engine(folder, t):
    """A step that ran the model at t (seconds), and an idle step after it."""
    write(folder, 1, [("core.step", t, t + 0.060), ("core.schedule", t, t + 0.001), ("core.wait_execute_model", t + 0.001, t + 0.047),
                      ("core.sample_tokens", t + 0.047, t + 0.050), ("core.update_from_output", t + 0.0505, t + 0.052),
                      ("core.step", t + 0.1, t + 0.101), ("core.schedule", t + 0.1, t + 0.1002), ("core.wait_execute_model", t + 0.1002, t + 0.1006),
                      ("core.update_from_output", t + 0.1006, t + 0.1008)])
    write(folder, 2, [("worker.execute_model", t + 0.002, t + 0.046), ("worker.model_forward", t + 0.004, t + 0.040),
                      ("worker.sample_tokens", t + 0.0475, t + 0.0495), ("worker.execute_model", t + 0.1003, t + 0.1004)])


def test_a_step_that_ran_the_model_is_split_into_its_parts(tmp_path):
    one_engine(tmp_path, 100.0)
    core, worker = engine_processes(tmp_path, GROUP)
    (step,) = forward_steps(core, worker, (99.0, 101.0))  # the idle step ran no model
    assert step == pytest.approx({"schedule": 1.0, "to_forward": 3.0, "model_forward": 36.0, "after_forward": 6.0, "answer_to_core": 1.0,
                                  "sample": 3.0, "output": 2.0, "step": 51.0}, abs=1e-6)
    assert forward_steps(core, worker, (101.0, 102.0)) == []  # outside the run's window


def test_the_report_reads_each_runs_window_and_engine(tmp_path, capsys):
    (tmp_path / "step-timeline").mkdir()
    one_engine(tmp_path / "step-timeline", 100.0)
    run = {"run": "kvpush_qps1_in256_out16_iter1", "monotonic_window_s": [99.0, 101.0], "engine_groups": {"P": GROUP, "D": 7},
           "requests": [{"output_tokens": 3}, {"output_tokens": 2}, {"error": "no answer"}]}
    (tmp_path / "kvpush_qps1_in256_out16_iter1.json").write_text(json.dumps(run))
    assert main([str(tmp_path)]) == 0
    assert "kvpush_qps1_in256_out16_iter1" in capsys.readouterr().out
    table = json.loads((tmp_path / "step-timeline-P.json").read_text())
    assert table["kvpush_qps1_in256_out16_iter1"]["steps"] == 1
    assert table["kvpush_qps1_in256_out16_iter1"]["model_forward"]["p50"] == pytest.approx(36.0)
    assert table["kvpush_qps1_in256_out16_iter1"]["tokens_per_step"] == 5.0  # 5 output tokens over its one model step
    idle = table["kvpush_qps1_in256_out16_iter1"]["idle"]  # one idle step of 1 ms, 0.4 ms of it waiting for the worker; 2 completed
    assert (idle["steps"], idle["per_request"]) == (1, 0.5)
    assert idle["step"]["p50"] == pytest.approx(1.0) and idle["wait_worker"]["per_request"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="no engine core"):
        main([str(tmp_path), "--engine", "D"])


def test_a_results_dir_without_a_timeline_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path)])
    assert "--step-timeline" in capsys.readouterr().err
