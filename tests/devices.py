"""Tests that need a mesh of N devices of the default backend: 8 forced CPU devices in CI
(tests/conftest.py), but a one-GPU machine has one. Such a test skips there, saying why."""

import jax
import pytest


def require_devices(n: int) -> None:
    """Skip the calling test unless the default backend has at least `n` devices."""
    have = len(jax.devices())
    if have < n:
        pytest.skip(f"needs {n} {jax.default_backend()} devices for its mesh, {have} present")
