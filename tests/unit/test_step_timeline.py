# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""bench.step_timeline: an engine step's parts from the engine core's and the worker's timeline files."""

from __future__ import annotations

import json

import pytest

from bench.step_timeline import engine_processes, forward_steps, main, summarize_wait_tails, wait_tail_parts

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


def test_d_wait_tails_are_split_at_the_steps_around_them(tmp_path, capsys):
    """KV seen in a held idle step, in a running forward, and between two steps; each tail ends in a later schedule()."""
    t = 200.0
    folder = tmp_path / "step-timeline"
    folder.mkdir()
    write(folder, 1, [
        # idle step the KV lands in (at t+0.002): the worker answers at t+0.0024, the core has it at t+0.0030, step ends t+0.0032;
        # vLLM sleeps, the next schedule() starts at t+0.0045 and takes the request at t+0.0047.
        ("core.step", t, t + 0.0032), ("core.schedule", t, t + 0.0002), ("core.wait_execute_model", t + 0.0002, t + 0.0030),
        ("core.update_from_output", t + 0.0030, t + 0.0032),
        ("core.step", t + 0.0045, t + 0.020), ("core.schedule", t + 0.0045, t + 0.0048), ("core.wait_execute_model", t + 0.0048, t + 0.017),
        ("core.sample_tokens", t + 0.017, t + 0.018), ("core.update_from_output", t + 0.018, t + 0.020),
        # the next step starts 0.1 ms after: a KV seen mid-forward above (t+0.010) is scheduled in it.
        ("core.step", t + 0.0201, t + 0.030), ("core.schedule", t + 0.0201, t + 0.0203),
    ])
    write(folder, 2, [("worker.execute_model", t + 0.0003, t + 0.0024), ("worker.execute_model", t + 0.005, t + 0.016),
                      ("worker.model_forward", t + 0.006, t + 0.015)])
    core, worker = engine_processes(folder, GROUP)
    tails = [[t + 0.002, t + 0.0047], [t + 0.010, t + 0.0202], [t + 0.0035, t + 0.0047]]
    idle, model, between = wait_tail_parts(core, worker, tails)
    assert idle["seen_in"] == "idle"
    assert {k: idle[k] for k in ("worker_answers", "answer_to_core", "output", "rest_of_step", "loop", "to_scheduled", "tail")} == pytest.approx(
        {"worker_answers": 0.4, "answer_to_core": 0.6, "output": 0.2, "rest_of_step": 1.2, "loop": 1.3, "to_scheduled": 0.2, "tail": 2.7}, abs=1e-6)
    assert model["seen_in"] == "model" and "worker_answers" not in model
    assert (model["rest_of_step"], model["loop"], model["to_scheduled"]) == pytest.approx((10.0, 0.1, 0.1), abs=1e-6)
    assert between["seen_in"] == "between" and (between["rest_of_step"], between["loop"], between["to_scheduled"]) == pytest.approx((0.0, 1.0, 0.2), abs=1e-6)
    table = summarize_wait_tails([idle, model, between])
    assert table["idle"]["requests"] == 1 and table["idle"]["worker_answers"] == pytest.approx(0.4)
    assert "worker_answers" not in table["model"]  # only an idle step's rest is split
    # A tail whose schedule() is not in the timeline is left out.
    assert wait_tail_parts(core, worker, [[t + 0.025, t + 0.040]]) == []
    # The report prints them for D from the run's breakdown.
    run = {"run": "kvpush_qps1_in256_out16_iter1", "monotonic_window_s": [t - 1, t + 1], "engine_groups": {"P": 7, "D": GROUP},
           "requests": [{"output_tokens": 2}] * 3, "summary": {"breakdown": {"d_wait_tails_monotonic_s": tails}}}
    (tmp_path / "kvpush_qps1_in256_out16_iter1.json").write_text(json.dumps(run))
    assert main([str(tmp_path), "--engine", "D"]) == 0
    assert "D's wait tail" in capsys.readouterr().out
    printed = json.loads((tmp_path / "step-timeline-D.json").read_text())["kvpush_qps1_in256_out16_iter1"]["wait_tail"]
    assert {kind: printed[kind]["requests"] for kind in printed} == {"idle": 1, "model": 1, "between": 1}
