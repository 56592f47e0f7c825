"""Regenerate the TensorRT and cuda-python API name lists the API test checks our code against.

Neither TensorRT's libraries nor a GPU are needed: TensorRT's *bindings* wheel
(``tensorrt-cu1X-bindings``, about 1 MB, installed with ``--no-deps``) holds
``tensorrt_bindings/tensorrt.so``, a pybind11 module whose string table names
every class, method, property and enum value of its Python API. It cannot be
imported without the libraries, so the names are read from the file: every
string that is a Python identifier. The linker merges a string into another
that ends with it (``num_errors`` lives inside ``get_num_errors``), so the test
treats a name as present when it is one of these strings or the end of one.
Names that ``tensorrt/__init__.py`` adds in Python (``nptype``, ``volume``,
``__version__``) are read from that file.

``cuda.bindings.runtime`` *can* be imported without a GPU or driver, so its
names come from ``dir()`` of the module and of its classes.

Usage (downloads the wheels with pip into a temporary directory)::

    .venv/bin/python scripts/gen_api_names.py

Writes ``tests/data/api_names/<package>-<version>.txt``: a header naming the
wheel, then one name a line, sorted.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "api_names"

#: The oldest TensorRT release the backend supports and the newest one checked.
TENSORRT_WHEELS = ("tensorrt-cu12-bindings==10.8.0.43", "tensorrt-cu13-bindings==11.4.0.106")
#: cuda-python's runtime bindings: the oldest release with ``cuda.bindings`` and the newest checked.
CUDA_WHEELS = ("cuda-bindings==12.8.0", "cuda-bindings==13.5.0")

IDENTIFIER = re.compile(rb"[A-Za-z_][A-Za-z0-9_]{1,79}")

DUMP_CUDA_NAMES = """
import inspect, sys
from cuda.bindings import runtime as cudart
names = set()
for name in dir(cudart):
    if name.startswith("__"):
        continue
    names.add(name)
    value = getattr(cudart, name)
    if inspect.isclass(value):
        names.update(f"{name}.{member}" for member in dir(value) if not member.startswith("__"))
sys.stdout.write("\\n".join(sorted(names)))
"""


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], check=True)


def tensorrt_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        binary = archive.read("tensorrt_bindings/tensorrt.so")
        init = archive.read("tensorrt_bindings/__init__.py").decode()
    names = set()
    for chunk in binary.split(b"\0"):
        if IDENTIFIER.fullmatch(chunk) and not chunk.startswith(b"_Z"):
            names.add(chunk.decode())
    for node in ast.walk(ast.parse(init)):
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names.add(target.id)
                elif isinstance(target, ast.Attribute):
                    names.add(target.attr)
    return names


def write(path: Path, header: str, names: set[str]) -> None:
    path.write_text(header + "\n" + "\n".join(sorted(names)) + "\n")
    print(f"{path.relative_to(ROOT)}: {len(names)} names")


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for requirement in TENSORRT_WHEELS:
            download = Path(tmp) / requirement
            pip("download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
                "-d", str(download), requirement)  # fmt: skip
            wheel = next(download.glob("*.whl"))
            version = requirement.split("==")[1]
            write(
                OUT / f"tensorrt-{version}.txt",
                f"# Python API names of TensorRT {version}, from {wheel.name} (scripts/gen_api_names.py)",
                tensorrt_names(wheel),
            )
        for requirement in CUDA_WHEELS:
            target = Path(tmp) / requirement
            extra = ["cuda-pathfinder"] if requirement.split("==")[1] >= "13" else []
            pip("install", "--quiet", "--no-deps", "--only-binary=:all:", "--target", str(target), requirement, *extra)
            dumped = subprocess.run(
                [sys.executable, "-c", DUMP_CUDA_NAMES],
                check=True,
                capture_output=True,
                text=True,
                env={"PYTHONPATH": str(target)},
            ).stdout
            version = requirement.split("==")[1]
            write(
                OUT / f"cuda-bindings-{version}.txt",
                f"# names of cuda.bindings.runtime in cuda-bindings {version} (scripts/gen_api_names.py)",
                set(dumped.split()),
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
