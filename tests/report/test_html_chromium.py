# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The HTML report opened in headless Chromium (Debian's `chromium`): the charts are in the DOM and on screen."""

from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from kvpush.report import SEGMENTS, breakdown
from kvpush.report.render import SEGMENT_COLORS, html_report
from kvpush.telemetry import read_spans
from tests.report.synthetic import routed_request, write_trace_file

pytestmark = pytest.mark.browser

CHROMIUM_TIMEOUT_S = 90
# Flags for this machine's closed network: no background fetches, no sandbox as root.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]
TRACE_IDS = [f"{n:02x}f7651916cd43dd8448eb211c80319c" for n in range(4)]


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: scripts/setup-env.sh installs it (apt-get install -y chromium)")
        pytest.skip("chromium is not installed (scripts/setup-env.sh installs it)")
    return path


class ElementCounter(HTMLParser):
    """Counts start tags by (tag, class) and collects every URL-bearing attribute."""

    def __init__(self):
        super().__init__()
        self.counts: dict[tuple[str, str], int] = {}
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        for cls in (attributes.get("class") or "").split() or [""]:
            self.counts[(tag, cls)] = self.counts.get((tag, cls), 0) + 1
        self.urls += [value for name, value in attrs if name in ("src", "href") and value]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """A report of four requests: three complete, one not streamed (no first output read nor TTFT: no D-output or router bar)."""
    work = tmp_path_factory.mktemp("report")
    spans = [item for i, trace_id in enumerate(TRACE_IDS) for item in routed_request(trace_id, f"t{i}", offset_ms=100 * i, scale=1 + i, streamed=i != 3)]
    result = breakdown(read_spans(write_trace_file(work / "traces.jsonl", spans)))
    page = work / "report.html"
    page.write_text(html_report(result, "test report", ["traces.jsonl"]), encoding="utf-8")
    return work, page, result


def run_chromium(work: Path, *args: str) -> subprocess.CompletedProcess:
    profile = work / f"profile-{len(list(work.glob('profile-*')))}"
    return subprocess.run([chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, timeout=CHROMIUM_TIMEOUT_S, check=True)


def test_page_is_self_contained(report):
    _, page, _ = report
    counter = ElementCounter()
    counter.feed(page.read_text())
    assert counter.urls == []
    assert ("script", "") not in counter.counts and ("link", "") not in counter.counts


def test_chromium_dom_has_every_bar(report):
    work, page, result = report
    dom = run_chromium(work, "--dump-dom", page.as_uri()).stdout.decode()
    counter = ElementCounter()
    counter.feed(dom)
    present = sum(value is not None for r in result.requests for value in r.segments.values())
    assert present == 3 * len(SEGMENTS) + len(SEGMENTS) - 2
    assert counter.counts[("svg", "chart")] == 1 + len(result.requests)
    assert counter.counts[("rect", "segment")] == present
    assert counter.counts[("svg", "waterfall")] == len(result.requests)
    assert counter.counts[("rect", "waterfall-bar")] == present


def test_chromium_screenshot_shows_every_segment_color(report):
    import matplotlib.image

    work, page, _ = report
    shot = work / "shot.png"
    run_chromium(work, f"--screenshot={shot}", "--window-size=1200,1400", "--hide-scrollbars", page.as_uri())
    pixels = (matplotlib.image.imread(shot)[:, :, :3] * 255).round().astype(int)
    assert (pixels != 255).any(), "the screenshot is blank"
    for segment in SEGMENTS:
        color = np.array([int(SEGMENT_COLORS[segment.name][i:i + 2], 16) for i in (1, 3, 5)])
        assert (np.abs(pixels - color).max(axis=2) <= 2).sum() > 50, f"no {segment.name} bar on screen"
