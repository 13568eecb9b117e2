"""Regenerate the Python code of proto/tide/v1/*.proto, in place.

The only writer of proto/tide/v1/*_pb2*.py(i). `--check` regenerates into a
temporary folder and exits 1 if anything differs from what is committed, so
CI catches a .proto edited without regenerating.
"""

from __future__ import annotations

import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PKG = Path("tide") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def generate(out: Path) -> None:
    sources = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PKG).glob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    # mypy-protobuf's plugins sit beside this interpreter; naming them keeps
    # generation independent of PATH.
    bindir = Path(sys.executable).parent
    args = [
        "grpc_tools.protoc",
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def generated_files(base: Path) -> dict[str, Path]:
    return {
        p.name: p
        for p in (base / PKG).iterdir()
        if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
    }


def main(argv: list[str]) -> int:
    check = "--check" in argv
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        (out / PKG).mkdir(parents=True)
        generate(out)
        fresh = generated_files(out)
        committed = generated_files(PROTO_ROOT)
        if check:
            differ = sorted(
                name
                for name in fresh.keys() | committed.keys()
                if name not in fresh
                or name not in committed
                or not filecmp.cmp(fresh[name], committed[name], shallow=False)
            )
            if differ:
                print("generated code drifted from proto/: " + ", ".join(differ), file=sys.stderr)
                print("run `make proto` and commit the result", file=sys.stderr)
                return 1
            return 0
        for name, path in committed.items():
            if name not in fresh:
                path.unlink()
        for name, path in fresh.items():
            shutil.copyfile(path, PROTO_ROOT / PKG / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
