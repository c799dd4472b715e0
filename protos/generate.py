"""Regenerate the committed protobuf/gRPC modules from shard.proto.

python -m paramshard.protos.generate            # writes protos/shard_pb2*.py(i)
python -m paramshard.protos.generate --check    # exits 1 if the committed files differ

The folder protos/ installs as ``paramshard.protos``, so protoc sees it under that name
(``-Iparamshard/protos=protos``): the stubs import ``from paramshard.protos import shard_pb2``
and the descriptor is ``paramshard/protos/shard.proto`` in protobuf's pool, where it cannot
clash with another project's ``shard.proto``. The wire (package ``paramshard.v1``) is the same.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
VIRTUAL = "paramshard/protos"
OUTPUTS = ("shard_pb2.py", "shard_pb2.pyi", "shard_pb2_grpc.py")


def generate(out_root: pathlib.Path) -> None:
    """Run protoc (from grpcio-tools), this folder as ``paramshard/protos``, into ``out_root``."""
    from grpc_tools import protoc

    (out_root / VIRTUAL).mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{VIRTUAL}={HERE}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"{VIRTUAL}/shard.proto",
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
            fresh = pathlib.Path(tmp, VIRTUAL, name)
            committed = HERE / name
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
