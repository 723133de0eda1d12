# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Where an engine step's time goes, per sweep run: `python -m bench.step_timeline <results-dir>`.

Reads what `bench.sweep --step-timeline` recorded (bench/engine_hooks: each
engine process's calls of the step's parts on CLOCK_MONOTONIC) and, for every
step of a run that ran the model on the chosen engine (P by default), splits
the engine core's schedule → output into:

    schedule            the scheduler's schedule()
    to_forward          schedule end → the worker's model forward starts (broadcast, input preparation)
    model_forward       the model's forward (GPUModelRunner._model_forward)
    after_forward       forward end → the worker's execute_model returns (a connector's wait_for_save, get_finished)
    answer_to_core      execute_model returned → the engine core has the answer
    sample              the engine core's sample_tokens call (RPC to the worker and back)
    output              sample_tokens returned → update_from_output done
    step                schedule end → update_from_output done: vLLM's "prefill time" of a prompt done in one step

and prints p50 and mean of each, per run, with the run's output tokens per
model step (on D, its mean batch: the step time, and so TPOT, follows it).
Then the steps that ran no model (on D: while its requests wait for their KV,
vLLM's engine core steps every 1 ms; a connector may hold such a step in
its worker): how many per completed request, how long each took, and how
long of it the engine core waited for the worker's answer. vLLM's engine
core spins on that answer (`sched_yield`, up to `--vllm-spin-ms`), so a
worker that sleeps in an idle step keeps its engine core on the CPU.
With `--engine D` and kvpush's spans (the run's breakdown keeps each
request's "KV in" and "D scheduled" instants), a third table takes D's wait
tail apart at the engine steps around it: how long the step the KV was seen
in still ran, of an idle step how much of that was kvpush's worker ending the
step and how much vLLM's answer path, then vLLM's loop to the next schedule
(it sleeps 1 ms after a step that ran no model) and that schedule.
The engine core and worker are told apart by what they recorded; one worker
per engine (TP 1).
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

PARTS = ("schedule", "to_forward", "model_forward", "after_forward", "answer_to_core", "sample", "output", "step")

Calls = dict[str, list[tuple[float, float]]]


def read_calls(path: Path) -> Calls:
    """part -> sorted (start, end) of one process's timeline file."""
    calls: Calls = defaultdict(list)
    for line in path.read_text().splitlines():
        part, start, end = line.split()
        calls[part].append((float(start), float(end)))
    return {part: sorted(spans) for part, spans in calls.items()}


def engine_processes(folder: Path, group: int) -> tuple[Calls, Calls]:
    """(engine core, worker) calls of the engine whose process group is `group`."""
    core: Calls | None = None
    worker: Calls | None = None
    for path in sorted(folder.glob(f"{group}-*.log")):
        calls = read_calls(path)
        if "core.step" in calls:
            core = calls
        elif "worker.execute_model" in calls and (worker is None or len(calls["worker.execute_model"]) > len(worker["worker.execute_model"])):
            worker = calls
    if core is None or worker is None:
        raise ValueError(f"no engine core and worker timeline of process group {group} in {folder}")
    return core, worker


def _within(spans: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The spans that start in [start, end]."""
    lo = bisect.bisect_left(spans, (start, float("-inf")))
    hi = bisect.bisect_right(spans, (end, float("inf")))
    return spans[lo:hi]


def _model_steps(core: Calls, worker: Calls, window: tuple[float, float]):
    """(schedule, forward, execute, answered, sample, update) spans of each step in `window` whose engine core called
    sample_tokens (the steps that ran the model)."""
    for step_start, step_end in _within(core.get("core.step", []), *window):
        sample = _within(core.get("core.sample_tokens", []), step_start, step_end)
        schedule = _within(core.get("core.schedule", []), step_start, step_end)
        update = _within(core.get("core.update_from_output", []), step_start, step_end)
        if not (sample and schedule and update):
            continue
        answered = [w for w in _within(core.get("core.wait_execute_model", []), step_start, step_end) if w[1] <= sample[0][0]]
        executed = [e for e in _within(worker.get("worker.execute_model", []), schedule[0][1], sample[0][0])
                    if _within(worker.get("worker.model_forward", []), e[0], e[1])]
        if not (answered and executed):
            continue
        execute = executed[-1]
        forward = _within(worker["worker.model_forward"], execute[0], execute[1])[0]
        yield schedule[0], forward, execute, answered[-1], sample[0], update[0]


def forward_steps(core: Calls, worker: Calls, window: tuple[float, float]) -> list[dict[str, float]]:
    """The parts (ms) of each step in `window` that ran the model."""
    steps = []
    for schedule, forward, execute, answered, sample, update in _model_steps(core, worker, window):
        parts = {
            "schedule": schedule[1] - schedule[0],
            "to_forward": forward[0] - schedule[1],
            "model_forward": forward[1] - forward[0],
            "after_forward": execute[1] - forward[1],
            "answer_to_core": answered[1] - execute[1],
            "sample": sample[1] - sample[0],
            "output": update[1] - sample[1],
            "step": update[1] - schedule[1],
        }
        steps.append({k: v * 1000 for k, v in parts.items()})
    return steps


def forward_steps_spans(core: Calls, worker: Calls, window: tuple[float, float]) -> list[tuple[float, float, float]]:
    """(schedule end, forward start, update_from_output end) of each step in `window` that ran the model (CLOCK_MONOTONIC s)."""
    return [(schedule[1], forward[0], update[1]) for schedule, forward, _, _, _, update in _model_steps(core, worker, window)]


def idle_steps(core: Calls, window: tuple[float, float]) -> list[dict[str, float]]:
    """Each step in `window` that ran no model (no sample_tokens call): its length and the engine core's wait for the worker (ms)."""
    steps = []
    for step_start, step_end in _within(core.get("core.step", []), *window):
        if _within(core.get("core.sample_tokens", []), step_start, step_end):
            continue
        waits = _within(core.get("core.wait_execute_model", []), step_start, step_end)
        steps.append({"step": (step_end - step_start) * 1000, "wait_worker": sum(end - start for start, end in waits) * 1000})
    return steps


WAIT_TAIL_PARTS = ("worker_answers", "answer_to_core", "output", "rest_of_step", "loop", "to_scheduled", "tail")


def wait_tail_parts(core: Calls, worker: Calls, tails: list[list[float]]) -> list[dict[str, Any]]:
    """Each D wait tail (KV in at D, D scheduled; CLOCK_MONOTONIC s) split at the engine steps around it (ms).

    `seen_in` is the step the KV was seen in: "idle" (a step that ran no model,
    which kvpush's worker holds until the KV lands), "model" (a step whose
    forward was running: the consumer thread saw it) or "between" (between two
    steps, or after an idle step's answer had left the worker: a later step
    reports it). Parts:

        rest_of_step    KV in → that step ends (0 outside a step); of an idle step:
          worker_answers      KV in → the worker's execute_model returns (kvpush's connector ends the held step)
          answer_to_core      → the engine core has the answer (vLLM's queue)
          output              → the step ends (vLLM's update_from_output)
        loop            → the next schedule() starts (vLLM sleeps 1 ms after a step that ran no model)
        to_scheduled    → D scheduled the request (its schedule(), or later ones if that one did not take it)
    """
    steps = core.get("core.step", [])
    starts = [start for start, _ in steps]
    schedules = core.get("core.schedule", [])
    schedule_starts = [start for start, _ in schedules]
    result = []
    for kv_in, scheduled in tails:
        i = bisect.bisect_right(starts, kv_in) - 1
        step = steps[i] if i >= 0 and kv_in <= steps[i][1] else None
        after = step[1] if step is not None else kv_in
        j = bisect.bisect_left(schedule_starts, after)
        if j == len(schedules) or schedules[j][0] > scheduled:
            continue  # the timeline ends before it, or the request's step is not in it
        parts: dict[str, Any] = {"seen_in": "between", "rest_of_step": 0.0, "loop": schedules[j][0] - after,
                                 "to_scheduled": scheduled - schedules[j][0], "tail": scheduled - kv_in}
        if step is not None:
            model = bool(_within(core.get("core.sample_tokens", []), *step))
            parts["rest_of_step"] = step[1] - kv_in
            answered = _within(core.get("core.wait_execute_model", []), *step)
            # The worker's answer to this step: it may have begun after the KV was seen (by the consumer thread).
            executed = [e for e in _within(worker.get("worker.execute_model", []), *step) if kv_in <= e[1] <= step[1]]
            if model:
                parts["seen_in"] = "model"
            elif answered and executed:
                parts |= {"seen_in": "idle", "worker_answers": executed[0][1] - kv_in, "answer_to_core": answered[-1][1] - executed[0][1],
                          "output": step[1] - answered[-1][1]}
            # else: seen after the idle step's answer left the worker, so a later step reports it ("between")
        result.append({k: v * 1000 if isinstance(v, float) else v for k, v in parts.items()})
    return result


def summarize_wait_tails(tails: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind of step the KV was seen in: how many, and p50 of each part (ms)."""
    table: dict[str, Any] = {}
    for kind in ("idle", "model", "between"):
        of_kind = [t for t in tails if t["seen_in"] == kind]
        if of_kind:
            table[kind] = {"requests": len(of_kind),
                           **{part: statistics.median(t[part] for t in of_kind) for part in WAIT_TAIL_PARTS if part in of_kind[0]}}
    return table


def summarize(steps: list[dict[str, float]]) -> dict[str, Any]:
    return {"steps": len(steps), **{part: {"p50": statistics.median(s[part] for s in steps), "mean": statistics.mean(s[part] for s in steps)}
                                    for part in PARTS if steps}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_timeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("results_dir", type=Path, help="a bench.sweep --step-timeline results directory")
    parser.add_argument("--engine", choices=("P", "D"), default="P")
    args = parser.parse_args(argv)
    folder = args.results_dir / "step-timeline"
    if not folder.is_dir():
        parser.error(f"{folder} does not exist: run bench.sweep with --step-timeline")
    table = {}
    for path in sorted(args.results_dir.glob("*.json")):
        run = json.loads(path.read_text())
        if "monotonic_window_s" not in run:
            continue
        core, worker = engine_processes(folder, run["engine_groups"][args.engine])
        row = summarize(forward_steps(core, worker, tuple(run["monotonic_window_s"])))
        # On D every output token comes from a model step: this is its mean batch, which its step time (and TPOT) follows.
        tokens = sum(request.get("output_tokens", 0) for request in run.get("requests", []))
        row["tokens_per_step"] = round(tokens / row["steps"], 2) if row["steps"] else None
        idle = idle_steps(core, tuple(run["monotonic_window_s"]))
        completed = sum(1 for request in run.get("requests", []) if not request.get("error"))
        row["idle"] = {
            "steps": len(idle),
            "per_request": round(len(idle) / completed, 1) if completed else None,
            **({part: {"p50": statistics.median(s[part] for s in idle), "per_request": sum(s[part] for s in idle) / completed}
                for part in ("step", "wait_worker")} if idle and completed else {}),
        }
        tails = run.get("summary", {}).get("breakdown", {}).get("d_wait_tails_monotonic_s")
        if args.engine == "D" and tails:
            row["wait_tail"] = summarize_wait_tails(wait_tail_parts(core, worker, tails))
        table[run["run"]] = row
    if not table:
        parser.error(f"no run with a recorded window in {args.results_dir}")
    print(f"{args.engine}'s steps that ran the model, ms (p50 / mean)")
    print(f"{'run':<44}{'steps':>6}{'tokens/step':>12}" + "".join(f"{p:>20}" for p in PARTS))
    for name, row in table.items():
        cells = "".join(f"{row[p]['p50']:>11.2f} /{row[p]['mean']:>7.2f}" if p in row else f"{'-':>20}" for p in PARTS)
        per_step = "-" if row["tokens_per_step"] is None else f"{row['tokens_per_step']:.2f}"
        print(f"{name:<44}{row['steps']:>6}{per_step:>12}{cells}")
    print(f"\n{args.engine}'s steps that ran no model: per completed request, and ms (p50 per step / sum per request)")
    print(f"{'run':<44}{'steps':>6}{'per request':>12}{'step':>20}{'engine core waits for worker':>32}")
    for name, row in table.items():
        idle = row["idle"]
        cells = "".join(f"{idle[p]['p50']:>11.2f} /{idle[p]['per_request']:>7.1f}" if p in idle else f"{'-':>20}" for p in ("step", "wait_worker"))
        print(f"{name:<44}{idle['steps']:>6}{idle['per_request'] if idle['per_request'] is not None else '-':>12}{cells:>52}")
    if any("wait_tail" in row for row in table.values()):
        print("\nD's wait tail (KV in -> D scheduled) by the step the KV was seen in: requests, and p50 ms of each part "
              "(worker_answers, answer_to_core and output split an idle step's rest)")
        print(f"{'run':<44}{'seen in':>9}{'requests':>9}" + "".join(f"{p:>15}" for p in WAIT_TAIL_PARTS))
        for name, row in table.items():
            for kind, parts in row.get("wait_tail", {}).items():
                cells = "".join(f"{parts[p]:>15.2f}" if p in parts else f"{'-':>15}" for p in WAIT_TAIL_PARTS)
                print(f"{name:<44}{kind:>9}{parts['requests']:>9}{cells}")
    (args.results_dir / f"step-timeline-{args.engine}.json").write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
