"""Test-wide settings: strict f32 matmuls (GPUs otherwise use TF32 for f32 dots), 8 CPU devices
for the sharding tests (set before any backend starts), the GPU marker, --update-golden."""

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_num_cpu_devices", 8)


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/golden/* from the current code")


def pytest_collection_modifyitems(config, items):
    if any(d.platform == "gpu" for d in jax.devices()):
        return
    skip = pytest.mark.skip(reason="needs a GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
