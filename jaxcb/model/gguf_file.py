"""A GGUF file's metadata and tensor table, read in one pass over its header; the tensors stay in the
memory-mapped file until a loader dequantizes them (with the `gguf` library's kernels).

Why not `gguf.GGUFReader`: it builds a numpy view for every element of every metadata array, which took
10-18 s for Gemma 3's 262,144-token vocabulary (2 s for SmolLM2's 49,152) on the 2-core CPU, at every
start. This reads the same header with `struct` (string arrays) and `np.frombuffer` (numeric arrays) in a
fraction of a second; the format (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) is:

    magic "GGUF", version (uint32, 2 or 3), tensor count (uint64), metadata count (uint64)
    metadata: key (string), value type (uint32), value    string = uint64 length + UTF-8 bytes
    tensor infos: name, n_dims (uint32), dims (uint64 each, fastest first), type (uint32), offset (uint64)
    tensor data: from the header's end rounded up to `general.alignment` (default 32), each at its offset
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
          "I64": np.int64}
_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
           7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    qtype: object  # gguf.GGMLQuantizationType
    dims: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    data: np.ndarray  # in the mapped file: typed for float/int types, bytes per row for block-quantized ones

    @property
    def shape(self) -> tuple[int, ...]:
        """The numpy (row-major) shape: the dims reversed."""
        return tuple(reversed(self.dims))


class GGUFFile:
    """`metadata`: key -> value (numbers and strings as Python values, string arrays as lists, numeric
    arrays as numpy arrays); `tensors`: name -> Tensor, in file order. Raises ValueError for a file
    that is not GGUF or is cut short."""

    def __init__(self, path: str):
        self.path = path
        self._buf = np.memmap(path, dtype=np.uint8, mode="r")
        self._mem = memoryview(self._buf)
        try:
            self._read_header()
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise ValueError(f"truncated or malformed header ({type(e).__name__}: {e})") from None

    def _unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._mem, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        end = self._pos + n
        if end > len(self._mem):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        s = bytes(self._mem[self._pos:end]).decode("utf-8", errors="replace")
        self._pos = end
        return s

    def _value(self, kind: int):
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = self._unpack("<I"), self._unpack("<Q")
        if item == _STRING:
            return [self._string() for _ in range(count)]
        if item in _DTYPES:
            dtype = np.dtype(_DTYPES[item])
            end = self._pos + count * dtype.itemsize
            if end > len(self._mem):
                raise ValueError(f"an array of {count} values runs past the end of the file")
            values = np.frombuffer(self._mem[self._pos:end], dtype=dtype).copy()
            self._pos = end
            return values
        return [self._value(item) for _ in range(count)]  # arrays of arrays: rare, small

    def _read_header(self) -> None:
        import gguf

        self._pos = 0
        if bytes(self._mem[:4]) != b"GGUF":
            raise ValueError("no GGUF magic number at the start")
        self._pos = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (this reader takes 2 and 3)")
        num_tensors, num_kv = self._unpack("<Q"), self._unpack("<Q")
        self.metadata: dict[str, object] = {}
        for _ in range(num_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
            infos.append((name, dims, self._unpack("<I"), self._unpack("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors: dict[str, Tensor] = {}
        for name, dims, raw_type, offset in infos:
            if name in self.tensors:
                raise ValueError(f"tensor {name} appears twice")
            qtype = gguf.GGMLQuantizationType(raw_type)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims, dtype=np.int64))
            nbytes = n // block * type_size
            begin = start + offset
            if begin + nbytes > len(self._buf):
                raise ValueError(f"tensor {name}'s data runs past the end of the file")
            raw = self._buf[begin:begin + nbytes]
            shape = tuple(reversed(dims))
            if qtype.name in _PLAIN:  # float and integer types: the values themselves
                data = raw.view(_PLAIN[qtype.name]).reshape(shape)
            else:  # block-quantized (and bfloat16): bytes, a row of blocks per row, as gguf.quants.dequantize takes
                data = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
            self.tensors[name] = Tensor(name, qtype, dims, data)
