# SPDX-License-Identifier: Apache-2.0
"""Pieces every kvpush service shares: clock, config, auth, server builder, tracing."""
