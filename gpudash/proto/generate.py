"""Regenerate the ``*_pb2.py`` modules of this folder from their ``.proto`` files.

Needs ``grpcio-tools`` (a development tool, not a dependency of gpudash); the committed
modules were made with grpcio-tools 1.75.1 (protoc for protobuf 6.31.1)::

    pip install grpcio-tools==1.75.1 && python gpudash/proto/generate.py

The generated code checks at import that the protobuf runtime is at least the version of
the protoc that made it; ``pyproject.toml`` pins ``protobuf`` to match.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> int:
    from grpc_tools import protoc

    here = Path(__file__).resolve().parent
    root = here.parent.parent  # the files register as gpudash/proto/NAME.proto
    status = 0
    for proto in sorted(here.glob("*.proto")):
        status |= protoc.main(["grpc_tools.protoc", f"-I{root}", f"--python_out={root}",
                               str(proto.relative_to(root))])
    return status


if __name__ == "__main__":
    sys.exit(main())
