# SPDX-License-Identifier: Apache-2.0
"""The short form of `python -m bench.chaos` in CI: the real local stack (control plane, P, D, router, vLLM CPU
engines) under steady mixed load while it is cut off, paused, killed and restarted, and fed colliding and
malformed keys. Every request must end right (the reference engine's tokens) or fail in time with its
reason, nothing may hang, and every KV block must be free again after each fault."""

from __future__ import annotations

import pytest

from bench.chaos.report import format_report
from bench.chaos.runner import run
from bench.chaos.settings import SHORT_ORDER, short_settings

pytestmark = pytest.mark.engine


def test_the_stack_keeps_its_guarantee_under_faults(model_dir, tmp_path):
    result = run(short_settings(run_dir=tmp_path / "chaos", model_dir=model_dir), quiet=True)
    report = format_report(result)
    print(report)
    assert [fault["fault"] for fault in result["faults"]] == list(SHORT_ORDER)
    verdict = result["verdict"]
    missed = [name for name, held in verdict["targets"].items() if not held]
    assert not missed, f"targets missed: {missed}\n{report}"
    # Each fault actually happened: requests ran through it and some were served on both sides of it.
    for fault in result["faults"]:
        assert fault["routed"]["requests"] > 0 and fault["routed"]["ok"] > 0, fault["fault"]
    by_name = {fault["fault"]: fault for fault in result["faults"]}
    assert by_name["disconnects"]["routed"]["disconnected"] > 0
    assert by_name["proxy-cut"]["notes"]["cut_connections"] > 0
    assert by_name["p-kill"]["notes"]["new_pid"] != by_name["p-kill"]["notes"]["killed_pid"]
    collisions = by_name["collide"]["notes"]["collisions"]
    assert collisions and all(case["at_most_one_decode_answered"] for case in collisions)
    # A key held by a request with another prompt: P refuses to fill it with its own prompt's KV.
    [other_prompt] = [case for case in collisions if case["order"] == "other-prompt-first"]
    assert other_prompt["broker"]["end_reason"] == "END_REASON_PROMPT_MISMATCH", other_prompt
    # Malformed parameters straight to an engine are answered (refused or served), never hung or wrong.
    malformed = by_name["collide"]["notes"]["malformed"]
    assert malformed and all(case["result"] in ("ok", "failed") for case in malformed)
    # A failure that reached a client through the router carried its reason.
    assert verdict["failures_without_reason"] == 0 and verdict["late_failures"] == 0
