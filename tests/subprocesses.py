"""The environment of a Python subprocess a test starts."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**overrides: str) -> dict[str, str]:
    """This process's environment with the checkout first on PYTHONPATH (the child imports it
    uninstalled), keeping the paths already there (packages installed outside site-packages)."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **overrides)
