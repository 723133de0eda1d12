# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The TTFT breakdown: critical-path segments per request from OTLP traces, as a table, HTML and PNG."""

from kvpush.report.breakdown import SEGMENTS, Breakdown, RequestBreakdown, Segment, breakdown
from kvpush.report.percentiles import percentile

__all__ = ["SEGMENTS", "Breakdown", "RequestBreakdown", "Segment", "breakdown", "percentile"]
