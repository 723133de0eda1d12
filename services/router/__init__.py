# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The OpenAI-compatible P/D router: picks a prefill and a decode engine per request and drives both legs."""
