"""The wire format between the grader and a box, both directions, shared by both sides.

A message is an 8-byte little-endian length, a JSON header, then the binary blobs the header lists.
Arrays travel as raw bytes or ``.npy`` blobs read with ``allow_pickle=False``; nothing is ever unpickled,
and every value decoded is checked to be plain data. Only the grader decides what a result means.

Standard library only at the top (NumPy is imported where arrays are encoded or decoded): the grader copies
this file into the box's runtime folder beside ``child.py``, which imports it before the sandbox exists.
"""
from __future__ import annotations

import io
import json
import os
import re
import struct

LENGTH = struct.Struct("<Q")
MAX_DEPTH = 64  # nesting of lists/tuples/dicts in one message
MAX_DIMS = 32
RAW_DTYPE = re.compile(r"^[<>|=]?[biufc]\d{1,2}$")  # plain numeric or bool dtypes, e.g. <f4, |b1
CONTROL_BYTES = 1 << 16  # largest control message (one JSON object per datagram)
MESSAGE_CHARS = 4000  # of an error message or traceback from a box, kept
PLAIN = frozenset({type(None), bool, int, float, str})  # the types a value may have that JSON carries as they are

class ProtocolError(Exception):
    """A message that does not follow the wire format (or breaks its limits)."""


# ---------------------------------------------------------------- encoding

def encode(value, blobs, depth=0):
    """Turn a plain value into JSON-able data; arrays go to ``blobs`` as .npy bytes."""
    if type(value) in PLAIN and depth <= MAX_DEPTH:  # (most nodes: answered before anything else is looked up)
        return value
    import numpy as np

    if depth > MAX_DEPTH:
        raise ProtocolError("value nested too deeply")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)
        if array.dtype.kind in "biufc" and not array.dtype.hasobject:
            # Raw bytes with dtype and shape in the header: cheaper than .npy for the small
            # arrays the tests exchange, and just as free of pickle.
            # Memory order as .npy keeps it: Fortran order for an F- but not C-contiguous array.
            fortran = bool(array.flags.f_contiguous and not array.flags.c_contiguous)
            blobs.append((array.T if fortran else array).tobytes())
            if isinstance(value, np.ndarray):
                return {"__raw__": [len(blobs) - 1, array.dtype.str, list(array.shape), fortran]}
            return {"__rawscalar__": [len(blobs) - 1, array.dtype.str]}
        buffer = io.BytesIO()
        np.save(buffer, np.asarray(value), allow_pickle=False)
        blobs.append(buffer.getvalue())
        key = "__array__" if isinstance(value, np.ndarray) else "__scalar__"
        return {key: len(blobs) - 1}
    if isinstance(value, list):
        return [encode(v, blobs, depth + 1) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, blobs, depth + 1) for v in value]}
    if isinstance(value, dict):
        return {"__dict__": [[encode(k, blobs, depth + 1), encode(v, blobs, depth + 1)] for k, v in value.items()]}
    raise ProtocolError(f"cannot send a {type(value).__module__}.{type(value).__name__}")


def decode(data, blobs, depth=0):
    """The inverse of ``encode``, checking every node: what comes back is plain data only."""
    if type(data) in PLAIN and depth <= MAX_DEPTH:  # (most nodes)
        return data
    if depth > MAX_DEPTH:
        raise ProtocolError("value nested too deeply")
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode(v, blobs, depth + 1) for v in data]
    if not isinstance(data, dict) or len(data) != 1:
        raise ProtocolError("malformed value")
    (tag, inner), = data.items()
    if tag in ("__raw__", "__rawscalar__"):
        return _raw_array(tag, inner, blobs)
    if tag in ("__array__", "__scalar__"):
        import numpy as np

        if type(inner) is not int or not 0 <= inner < len(blobs):
            raise ProtocolError("bad array reference")
        try:
            array = np.lib.format.read_array(io.BytesIO(blobs[inner]), allow_pickle=False)
        except Exception as exc:  # truncated data, object dtype, bad header...
            raise ProtocolError(f"unreadable array: {exc}") from None
        if array.dtype.kind not in "biufc" or array.dtype.hasobject:
            raise ProtocolError(f"arrays must be numeric or bool, not {array.dtype}")
        return array[()] if tag == "__scalar__" else array
    if tag == "__tuple__" and isinstance(inner, list):
        return tuple(decode(v, blobs, depth + 1) for v in inner)
    if tag == "__dict__" and isinstance(inner, list):
        result = {}
        for pair in inner:
            if not isinstance(pair, list) or len(pair) != 2:
                raise ProtocolError("malformed dict entry")
            key = decode(pair[0], blobs, depth + 1)
            if not (key is None or isinstance(key, (bool, int, float, str))):
                raise ProtocolError("dict keys must be strings or numbers")
            result[key] = decode(pair[1], blobs, depth + 1)
        return result
    raise ProtocolError(f"unknown tag {tag!r}")


def _raw_array(tag, inner, blobs):
    """A "__raw__" array (or "__rawscalar__"): blob index, dtype string and shape, all checked."""
    import numpy as np

    size = 4 if tag == "__raw__" else 2
    if not isinstance(inner, list) or len(inner) != size:
        raise ProtocolError("malformed array")
    index, dtype = inner[0], inner[1]
    shape, fortran = (inner[2], inner[3]) if tag == "__raw__" else ([], False)
    if type(fortran) is not bool:
        raise ProtocolError("malformed array")
    if type(index) is not int or not 0 <= index < len(blobs):
        raise ProtocolError("bad array reference")
    if not isinstance(dtype, str) or not RAW_DTYPE.match(dtype):
        raise ProtocolError("arrays must be numeric or bool")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(type(n) is int and n >= 0 for n in shape):
        raise ProtocolError("bad array shape")
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise ProtocolError("bad array dtype") from None
    if dtype.kind not in "biufc" or dtype.hasobject:
        raise ProtocolError(f"arrays must be numeric or bool, not {dtype}")
    data = blobs[index]
    count = 1
    for n in shape:
        count *= n
    if count * dtype.itemsize != len(data):
        raise ProtocolError(f"unreadable array: {len(data)} bytes for shape {shape} of {dtype}")
    array = np.frombuffer(data, dtype=dtype, count=count)
    array = array.reshape(shape[::-1]).T.copy(order="F") if fortran else array.reshape(shape).copy()
    return array[()] if tag == "__rawscalar__" else array


def pack(header, blobs=()):
    """One message as bytes: length, JSON header (with the blob sizes), blobs."""
    header = dict(header, blobs=[len(b) for b in blobs])
    text = json.dumps(header).encode()
    return b"".join([LENGTH.pack(len(text)), text, *blobs])


def write_message(fd, header, blobs=()):
    data = memoryview(pack(header, blobs))
    while data:
        data = data[os.write(fd, data):]


def read_exactly(fd, size):
    """Blocking read of ``size`` bytes (child side); None at end of file."""
    chunks = []
    while size:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def read_message(fd):
    """The child's reader: requests come from the trusted parent. None at end of file."""
    raw = read_exactly(fd, LENGTH.size)
    if raw is None:
        return None
    header = json.loads(read_exactly(fd, LENGTH.unpack(raw)[0]))
    blobs = [read_exactly(fd, n) for n in header.pop("blobs")]
    return header, blobs

def clip(text, limit=MESSAGE_CHARS) -> str:
    """A string from a box, cut to ``limit`` characters: its messages end up in every record."""
    text = str(text)
    return text if len(text) <= limit else text[:limit] + f" [... {len(text) - limit} more characters]"
