# SPDX-License-Identifier: Apache-2.0
"""The registrar: the directory of live engine ranks and their leases."""
