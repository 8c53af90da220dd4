"""A pass over a pickle's opcodes that rejects sizes no real pickler writes.

Two kinds of damage found by ``tests/test_fuzz_pt.py`` make CPython's C unpickler
misbehave before it notices anything is wrong, and both are refused here, before
``torch.load`` sees the pickle:

* **memo indices**: the unpickler stores its memo in an array indexed by the ``PUT``
  argument and grows it to twice that index. One flipped byte in a ``LONG_BINPUT``
  asked for index ~10⁹: gigabytes allocated and ~15 s spent clearing them, on a 3 KB
  shard. A pickler numbers its memo entries from 0 in order, so an index beyond the
  pickle's length in bytes is always damage.
* **counted lengths** past the end of the pickle (strings, bytes, bytearrays): a
  damaged ``BYTEARRAY8`` asked for 7·10¹⁸ bytes and left a bytearray freed while its
  buffer was still exported (CPython reports ``SystemError: deallocated bytearray
  object has exported buffers``).

The scan reads every opcode once without building anything (a few hundred nanoseconds
an opcode).
"""

from __future__ import annotations

import pickle
import pickletools
import struct

__all__ = ["check_pickle_bounds"]

_NEWLINE, _LENGTH1, _LENGTH4, _LENGTH4U, _LENGTH8U = (
    pickletools.UP_TO_NEWLINE, pickletools.TAKEN_FROM_ARGUMENT1,
    pickletools.TAKEN_FROM_ARGUMENT4, pickletools.TAKEN_FROM_ARGUMENT4U,
    pickletools.TAKEN_FROM_ARGUMENT8U,
)
_TWO_LINES = {"GLOBAL", "INST"}  # two newline-terminated strings
_PUTS = {"PUT": "text", "BINPUT": "<B", "LONG_BINPUT": "<I"}
# opcode byte -> (argument size or kind, name)
_ARGUMENTS = {ord(op.code): (op.arg.n if op.arg is not None else 0, op.name)
              for op in pickletools.opcodes}


def check_pickle_bounds(data: bytes | bytearray | memoryview, start: int = 0,
                       end: int | None = None) -> None:
    """Raise if a memo index or a counted length in ``data[start:end]`` exceeds the pickle.

    Opcodes this scan does not know end it quietly: the unpickler rejects them itself.

    Args:
        data: Buffer holding the pickle.
        start: Offset of its first opcode.
        end: Offset just past it. (default: the end of ``data``)

    Raises:
        pickle.UnpicklingError: A memo index larger than the pickle could ever need, or
            a counted string or buffer longer than what is left of it.
    """
    end = len(data) if end is None else end
    if isinstance(data, memoryview):
        data = bytes(data)
    find = data.find  # bytes, bytearray and mmap search in place
    limit = end - start
    at = start
    while at < end:
        entry = _ARGUMENTS.get(data[at])
        if entry is None:
            return
        size, name = entry
        opcode_at = at
        at += 1
        if name in _PUTS:
            if name == "PUT":
                newline = find(b"\n", at, end)
                text = bytes(data[at:newline]) if newline >= 0 else b""
                index = int(text) if text.isdigit() else 0
            else:
                index = struct.unpack_from(_PUTS[name], data, at)[0] if at + size <= end else 0
            if index > limit:
                raise pickle.UnpicklingError(
                    f"memo index {index} at byte {at - 1 - start} exceeds the pickle's "
                    f"{limit} bytes (a damaged pickle)"
                )
        if name == "STOP":
            return
        if size >= 0:
            at += size
        elif size == _NEWLINE:
            for _ in range(2 if name in _TWO_LINES else 1):
                newline = find(b"\n", at, end)
                if newline < 0:
                    return
                at = newline + 1
        elif size == _LENGTH1:
            at += 1 + (data[at] if at < end else 0)
        elif size in (_LENGTH4, _LENGTH4U):
            if at + 4 > end:
                return
            length = struct.unpack_from("<i" if size == _LENGTH4 else "<I", data, at)[0]
            if length < 0:
                return
            at += 4 + length
        elif size == _LENGTH8U:
            if at + 8 > end:
                return
            at += 8 + struct.unpack_from("<Q", data, at)[0]
        else:
            return
        if at > end:
            # a counted string, bytes or bytearray longer than what is left: CPython's
            # unpickler would try to allocate it (a damaged BYTEARRAY8 asked for 7e18
            # bytes and left a bytearray freed while its buffer was still exported)
            raise pickle.UnpicklingError(
                f"{name} at byte {opcode_at - start} runs {at - end} bytes past the end of "
                f"the pickle (a damaged pickle)"
            )
