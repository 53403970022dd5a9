"""Test set-up: several CPU devices, and emulated chip types registered before JAX starts.

The emulated cluster registered here is a superset of every test's cluster, because a
process can register backends only before JAX initialises them.
"""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

from xla_plugins import register_emulated_chips  # noqa: E402

# chip type -> (nodes, devices per node)
TEST_CLUSTER = {"sim_a": (2, 4), "sim_b": (2, 4), "sim_c": (1, 4), "sim_d": (1, 4)}
register_emulated_chips(TEST_CLUSTER)

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_numpy_rank_promotion", "raise")
