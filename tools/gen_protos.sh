#!/usr/bin/env bash
# Regenerate serve/proto/*_pb2*.py from protos/ (needs grpcio-tools). The generated code is committed
# so that a plain `pip install` gives an importable server; it needs protobuf >= the version of
# grpcio-tools' protoc (see pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
out=serve/proto
$PY -m grpc_tools.protoc -I protos/jaxcb/v1 --python_out=$out --pyi_out=$out --grpc_python_out=$out protos/jaxcb/v1/jaxcb.proto
$PY -m grpc_tools.protoc -I protos/jetstream_proto --python_out=$out --pyi_out=$out --grpc_python_out=$out protos/jetstream_proto/jetstream.proto
# protoc writes top-level imports (`import jaxcb_pb2`); inside the package they must be relative.
sed -i -E 's/^import (jaxcb|jetstream)_pb2 as/from . import \1_pb2 as/' $out/*_pb2_grpc.py
