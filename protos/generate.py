"""Regenerate the committed protobuf/gRPC modules from shard.proto.

python -m protos.generate            # writes protos/shard_pb2*.py(i)
python -m protos.generate --check    # exits 1 if the committed files differ
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUTPUTS = ("shard_pb2.py", "shard_pb2.pyi", "shard_pb2_grpc.py")


def generate(out_root: pathlib.Path) -> None:
    """Run protoc (from grpcio-tools) with the repo root as include path into ``out_root``."""
    from grpc_tools import protoc

    (out_root / "protos").mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{ROOT}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        str(ROOT / "protos" / "shard.proto"),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        generate(pathlib.Path(tmp))
        differ = []
        for name in OUTPUTS:
            fresh = pathlib.Path(tmp, "protos", name)
            committed = ROOT / "protos" / name
            if opts.check:
                if not committed.exists() or committed.read_bytes() != fresh.read_bytes():
                    differ.append(name)
            else:
                shutil.copyfile(fresh, committed)
    if differ:
        print(f"generated modules differ from shard.proto: {', '.join(differ)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
