# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""A whole chaos run: the stack started, the faults injected under load, the soak, the result written."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.chaos.faults import Chaos
from bench.chaos.log import Log
from bench.chaos.report import format_report, summarize_totals, verdict
from bench.chaos.settings import EMBEDDED_ONLY, FAULTS, SCALED_ONLY, Settings
from bench.chaos.soak import soak_both, soak_verdict
from bench.chaos.stack import Stack
from kvpush.dev.localstack.process import interrupt_on_signals
from kvpush.dev.tinymodel import build_tiny_model, default_model_dir


def run(settings: Settings, *, quiet: bool = False) -> dict[str, Any]:
    """Starts the stack, injects settings.faults under load, runs the soak if asked; returns the figures (also written to the run dir)."""
    run_dir = settings.run_dir or Path("runs") / time.strftime("chaos-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    settings = dataclasses.replace(settings, run_dir=run_dir)
    log = Log(run_dir / "chaos.log", quiet=quiet)
    unknown = [f for f in settings.faults if f not in FAULTS]
    if unknown:
        raise ValueError(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    misplaced = [f for f in settings.faults if f in (EMBEDDED_ONLY if settings.scaled else SCALED_ONLY)]
    if misplaced:
        raise ValueError(f"faults {misplaced} need the {'embedded' if settings.scaled else 'scaled-out'} control plane")
    if settings.scaled and settings.soak_attempts:
        raise ValueError("the soak measures the embedded control plane: run it without --scaled")
    started = time.monotonic()
    model_dir = build_tiny_model(settings.model_dir or default_model_dir())
    log(f"writing to {run_dir}; faults {', '.join(settings.faults)}; {settings.clients} clients; deadline {settings.timeout_ms} ms")
    stack = Stack(settings, run_dir, model_dir, log)
    result: dict[str, Any] = {"benchmark": "chaos", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv),
                              "settings": settings.as_dict(), "cpus": os.cpu_count()}
    faults: list[dict[str, Any]] = []
    soak_result = soak_checks = None
    try:
        stack.start()
        result["startup_s"] = round(time.monotonic() - started, 1)
        chaos = Chaos(stack, settings, log)
        for name in settings.faults:
            faults.append(chaos.run_fault(name))
        if settings.soak_attempts:
            log(f"=== soak: {settings.soak_attempts} attempts in flight at once at the control plane")
            try:
                soak_result = asyncio.run(soak_both(stack, settings, log))
                soak_checks = soak_verdict(soak_result)
            except Exception as exc:  # the faults' figures are kept; the soak counts as missed
                log(f"soak failed: {type(exc).__name__}: {exc}")
                soak_result, soak_checks = {}, {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
            log(f"soak: {json.dumps(soak_checks)}")
        result["logs"] = {name: str(run_dir / f"{name}.log") for name in ("prefill", "decode", "router", "reference")}
        result["logs"]["control-plane"] = str(stack.cp_dir / "control-plane.log")
        result["all_outcomes"] = len(chaos.load.outcomes)
        with (run_dir / "outcomes.jsonl").open("w", encoding="utf-8") as handle:
            for outcome in chaos.load.outcomes:
                handle.write(json.dumps(dataclasses.asdict(outcome)) + "\n")
    finally:
        stack.close()
    result["faults"] = faults
    result["total"] = summarize_totals(faults)
    if soak_result is not None:
        result["soak"] = {"raw": soak_result, "checks": soak_checks}
    result["verdict"] = verdict(faults, soak_checks)
    result["wall_s"] = round(time.monotonic() - started, 1)
    (run_dir / "result.json").write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
    return result


def fault_list(text: str) -> tuple[str, ...]:
    """The faults of a comma-separated --faults ('' for none)."""
    return tuple(fault for fault in text.split(",") if fault)


def run_and_report(settings: Settings, json_path: str | None, prog: str, runs: int = 1) -> int:
    """Runs settings `runs` times, one after another, each on a fresh stack, printing each report (and the result as JSON to
    json_path, '-' for stdout: one run's result, or {"runs": [...]} for several); the exit status (0: passed, 130: interrupted)."""
    results = []
    try:
        with interrupt_on_signals():
            for index in range(runs):
                each = settings
                if runs > 1 and settings.run_dir is not None:
                    each = dataclasses.replace(settings, run_dir=settings.run_dir / f"run-{index + 1}")
                results.append(run(each))
                print()
                print(format_report(results[-1]))
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (every process it started was stopped)", file=sys.stderr)
        return 130
    document: dict[str, Any] = results[0] if runs == 1 else {"command": " ".join([f"python -m bench.{prog}", *sys.argv[1:]]), "runs": results}
    if json_path == "-":
        print(json.dumps(document, default=str))
    elif json_path:
        Path(json_path).write_text(json.dumps(document, indent=1, default=str), encoding="utf-8")
    return 0 if all(result["verdict"]["passed"] for result in results) else 1
