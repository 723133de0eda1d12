# SPDX-License-Identifier: Apache-2.0
"""Pure layout arithmetic shared by the broker and the connector."""
