"""Regenerate the protobuf and gRPC code in ``kvxfer/v1`` from ``protos/``.

Run ``python -m kvxfer.protogen`` after editing a .proto file. The proto path
mirrors the package (``protos/kvxfer/v1/*.proto`` -> ``kvxfer.v1``), so the
generated imports are absolute and correct. grpcio-tools writes the runtime
modules and mypy-protobuf their typed stubs (``.pyi``), which ``mypy --strict``
checks the hand-written code against. A test regenerates into a temporary folder
and fails if the committed files are stale. Needs the dev extra.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTOS = REPO / "protos"
#: What protoc writes per proto file: runtime code (grpcio-tools) and stubs (mypy-protobuf).
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def proto_files() -> list[Path]:
    """Every .proto file of the API, relative to ``protos/``."""
    return sorted(p.relative_to(PROTOS) for p in PROTOS.rglob("*.proto"))


def _include_dirs() -> list[Path]:
    """Where imported protos live: google/protobuf (grpcio-tools), google/rpc (googleapis)."""
    import google.rpc.status_pb2
    import grpc_tools

    googleapis = Path(google.rpc.status_pb2.__file__).parent.parent.parent
    return [PROTOS, Path(grpc_tools.__file__).parent / "_proto", googleapis]


def _plugin(name: str) -> str:
    """The path of a protoc plugin installed beside this interpreter (mypy-protobuf's)."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found; install the dev extra (mypy-protobuf)")
    return found


def generate(out_dir: Path) -> list[Path]:
    """Write the generated modules and stubs under ``out_dir``; return their paths."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        *[f"-I{d}" for d in _include_dirs()],
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *[str(p) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return generated_files(out_dir)


def generated_files(root: Path) -> list[Path]:
    """The paths protoc writes under ``root`` for every proto file."""
    paths: list[Path] = []
    for proto in proto_files():
        stem = root / proto.with_suffix("")
        paths.extend(stem.with_name(stem.name + suffix) for suffix in SUFFIXES)
    return paths


if __name__ == "__main__":
    for path in generate(REPO):
        print(path.relative_to(REPO))
    sys.exit(0)
