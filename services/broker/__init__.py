# SPDX-License-Identifier: Apache-2.0
"""The rendezvous broker: matches destinations with prefill-done reports and fences attempts."""
