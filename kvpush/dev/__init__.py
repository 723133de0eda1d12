# SPDX-License-Identifier: Apache-2.0
"""Development tooling: the local stack, the simulation, the demo, the tiny models, code generation, the test etcd
cluster and sample engines. Imported by nothing that ships into an engine or a service."""
