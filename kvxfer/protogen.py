"""Regenerate the protobuf and gRPC code in ``kvxfer/v1`` from ``protos/``.

Run ``python -m kvxfer.protogen`` after editing a .proto file. The proto path
mirrors the package (``protos/kvxfer/v1/*.proto`` -> ``kvxfer.v1``), so the
generated imports are absolute and correct. A test regenerates into a temporary
folder and fails if the committed files are stale. Needs grpcio-tools (dev extra).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTOS = REPO / "protos"


def proto_files() -> list[Path]:
    """Every .proto file of the API, relative to ``protos/``."""
    return sorted(p.relative_to(PROTOS) for p in PROTOS.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Write the generated modules under ``out_dir``; return their paths."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTOS}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return generated_files(out_dir)


def generated_files(root: Path) -> list[Path]:
    """The paths protoc writes under ``root`` for every proto file."""
    paths = []
    for proto in proto_files():
        stem = root / proto.with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            paths.append(stem.with_name(stem.name + suffix))
    return paths


if __name__ == "__main__":
    for path in generate(REPO):
        print(path.relative_to(REPO))
    sys.exit(0)
