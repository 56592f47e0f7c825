"""Generate the Python stubs (messages, gRPC services and their .pyi) from protos/.

protoc names a generated module after its .proto path (``inference/...`` →
``import inference``). splitstream keeps every generated module inside its
shared package instead, so this script rewrites those absolute imports to
``splitstream.common.proto.<path>``. Output is removed and rebuilt on each run,
so the stubs always match the .proto files.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT = ROOT / "services" / "common" / "proto"
PACKAGE = "splitstream.common.proto"


def main() -> int:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    include = Path(protoc.__file__).parent / "_proto"
    # protoc finds the mypy-protobuf plugins on PATH; they sit beside this interpreter.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={OUT}",
        f"--pyi_out={OUT}",
        f"--grpc_python_out={OUT}",
        f"--mypy_grpc_out={OUT}",
        *protos,
    ]
    if protoc.main(args) != 0:
        print("protoc failed", file=sys.stderr)
        return 1
    top_levels = sorted({p.split("/")[0] for p in protos})
    pattern = re.compile(rf"^(from|import) ({'|'.join(map(re.escape, top_levels))})([. ])", re.M)
    for path in OUT.rglob("*.py*"):
        text = pattern.sub(rf"\1 {PACKAGE}.\2\3", path.read_text())
        path.write_text(text)
    for directory in [OUT, *(d for d in OUT.rglob("*") if d.is_dir())]:
        (directory / "__init__.py").touch()
    print(f"generated {len(protos)} protos into {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
