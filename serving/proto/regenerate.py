"""Regenerate the committed Python code of `dsv4_serving.proto`: `python -m serving.proto.regenerate`.

Runs grpcio-tools' bundled protoc with the repository root as the import path, so the
generated gRPC module imports `serving.proto.dsv4_serving_pb2`. The output depends on the
grpcio-tools version (its protoc and the version checks it writes), which is why the test
extra pins it; `tests/test_grpc_server.py` checks that the committed files are what this
writes.
"""

from __future__ import annotations

import os
import sys

PROTO = "serving/proto/dsv4_serving.proto"
GENERATED = ("dsv4_serving_pb2.py", "dsv4_serving_pb2.pyi", "dsv4_serving_pb2_grpc.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def regenerate(out_dir: str = ROOT) -> list[str]:
    """Write the generated files under `out_dir`/serving/proto/; returns their paths."""
    from grpc_tools import protoc

    os.makedirs(os.path.join(out_dir, "serving", "proto"), exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", os.path.join(ROOT, PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    return [os.path.join(out_dir, "serving", "proto", name) for name in GENERATED]


if __name__ == "__main__":
    for path in regenerate():
        print(path)
    sys.exit(0)
