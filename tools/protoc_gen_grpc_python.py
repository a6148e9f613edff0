"""`buf generate`'s plugin for Python gRPC stubs: grpcio-tools' own generator behind the plugin
protocol.

grpcio-tools compiles `--grpc_python_out` inside its bundled protoc and ships no
`protoc-gen-grpc_python` program, and buf runs only protoc's built-in languages (python, not
grpc_python) through a protoc. So this reads buf's `CodeGeneratorRequest`, hands its files to that
protoc as a descriptor set, and answers with what it wrote: the same stubs `python -m
grpc_tools.protoc --grpc_python_out` writes.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2
from google.protobuf.compiler import plugin_pb2
from grpc_tools import protoc


def main() -> int:
    request = plugin_pb2.CodeGeneratorRequest.FromString(sys.stdin.buffer.read())
    response = plugin_pb2.CodeGeneratorResponse(
        supported_features=plugin_pb2.CodeGeneratorResponse.FEATURE_PROTO3_OPTIONAL
    )
    with tempfile.TemporaryDirectory() as scratch:
        descriptors = Path(scratch, "descriptors.pb")
        descriptors.write_bytes(descriptor_pb2.FileDescriptorSet(file=request.proto_file).SerializeToString())
        out = Path(scratch, "out")
        out.mkdir()
        argv = ["protoc", f"--descriptor_set_in={descriptors}", f"--grpc_python_out={out}"]
        if protoc.main([*argv, *request.file_to_generate]) != 0:
            response.error = "grpc_tools.protoc could not generate the gRPC stubs"
        else:
            for path in sorted(p for p in out.rglob("*") if p.is_file()):
                response.file.add(name=str(path.relative_to(out)), content=path.read_text(encoding="utf-8"))
    sys.stdout.buffer.write(response.SerializeToString())
    return 0


if __name__ == "__main__":
    sys.exit(main())
