"""notebooks/quickstart.ipynb runs top to bottom without an error (nbclient, this Python as the kernel)."""

from __future__ import annotations

import os

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from tests.subprocesses import ROOT, child_env

NOTEBOOK = os.path.join(ROOT, "notebooks", "quickstart.ipynb")


def test_quickstart_notebook_runs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    # No kernel directories: only ipykernel's built-in spec, which launches sys.executable (this
    # venv), whatever kernels the machine has installed.
    km = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))
    # The repo root is the kernel's working directory (imports) and on its path (uninstalled checkouts).
    client = NotebookClient(nb, km=km, timeout=300, allow_errors=False, resources={"metadata": {"path": ROOT}})
    client.execute(env=child_env())  # raises CellExecutionError on the first failing cell
    assert all(c.get("outputs") is not None for c in nb.cells if c.cell_type == "code")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
