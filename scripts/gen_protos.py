"""Regenerate the Python code of the project's .proto files, in place.

The only writer of generated gRPC code: the Tide API (tide/v1, imported
as ``tide.v1``) and the agent's copy of the kubelet PodResources API
(tide/services/agent/podresources). `--check` regenerates into a temporary folder
and exits 1 if anything differs from what is committed, so CI catches a
.proto edited without regenerating.
"""

from __future__ import annotations

import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
# (include root, package folder under it): imports come out as the package path.
TARGETS = (
    (ROOT, Path("tide") / "v1"),
    (ROOT, Path("tide") / "services" / "agent" / "podresources"),
)
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def generate(proto_root: Path, pkg: Path, out: Path) -> None:
    sources = sorted(str(p.relative_to(proto_root)) for p in (proto_root / pkg).glob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    # mypy-protobuf's plugins sit beside this interpreter; naming them keeps
    # generation independent of PATH.
    bindir = Path(sys.executable).parent
    args = [
        "grpc_tools.protoc",
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        f"-I{proto_root}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def generated_files(folder: Path) -> dict[str, Path]:
    return {
        p.name: p for p in folder.iterdir() if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
    }


def main(argv: list[str]) -> int:
    check = "--check" in argv
    differ: list[str] = []
    for proto_root, pkg in TARGETS:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            (out / pkg).mkdir(parents=True)
            generate(proto_root, pkg, out)
            fresh = generated_files(out / pkg)
            committed = generated_files(proto_root / pkg)
            if check:
                differ += sorted(
                    str(pkg / name)
                    for name in fresh.keys() | committed.keys()
                    if name not in fresh
                    or name not in committed
                    or not filecmp.cmp(fresh[name], committed[name], shallow=False)
                )
                continue
            for name, path in committed.items():
                if name not in fresh:
                    path.unlink()
            for name, path in fresh.items():
                shutil.copyfile(path, proto_root / pkg / name)
    if differ:
        print("generated code drifted from its .proto: " + ", ".join(differ), file=sys.stderr)
        print("run `make proto` and commit the result", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
