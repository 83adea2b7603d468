"""A launch's payload: an anonymous, private file (a memfd: nothing on
disk to plant) holding fn and args pickled from its start, then a trailer
(a zygote launch's header, a spawned worker's preparation) pickled, then
the trailer's length.  The trailer comes last because it is made after the
work is pickled (the header counts the fds the arguments carry), and the
work is pickled straight into the file: a large argument is written once,
from the object, and read back once, into its unpickled copy.
"""

from __future__ import annotations

import io
import os
import pickle
import struct

from fastspawn._wire import pickling

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import IO, Any

_LENGTH = struct.Struct("=Q")


def new_memfd() -> int:
    return os.memfd_create("fastspawn-payload", os.MFD_CLOEXEC)


def write_work(fd: int, objects: Sequence[Any], collector: pickling.FdCollector) -> None:
    """Pickle ``objects`` (as pickling.dumps does) into the empty memfd
    ``fd``: a large object's bytes go from it to the file, not through a
    buffer of the whole pickle."""
    with open(fd, "wb", buffering=1 << 16, closefd=False) as file:
        pickling.dump(objects, collector, file)


def append_trailer(fd: int, data: bytes) -> None:
    """Write ``data`` (a pickle) and its length after the work."""
    view = memoryview(data + _LENGTH.pack(len(data)))
    while view:
        view = view[os.write(fd, view) :]


def drop_trailer(fd: int) -> None:
    """Take the trailer off again, leaving the work (a launch sent once
    more, with a header of its own)."""
    end = os.lseek(fd, 0, os.SEEK_END)
    (size,) = _LENGTH.unpack(os.pread(fd, _LENGTH.size, end - _LENGTH.size))
    start = end - _LENGTH.size - size
    os.ftruncate(fd, start)
    os.lseek(fd, start, os.SEEK_SET)


def read_trailer(payload: IO[bytes]) -> tuple[Any, int]:
    """The payload's trailer, unpickled, and where it starts (the size of
    the work before it); ``payload`` is left at the start of the work."""
    end = payload.seek(-_LENGTH.size, os.SEEK_END)
    (size,) = _LENGTH.unpack(payload.read(_LENGTH.size))
    start = payload.seek(end - size)
    value = pickle.load(payload)
    payload.seek(0)
    return value, start


READ_WHOLE = 1 << 16


class _PayloadFile(io.RawIOBase):
    """A payload memfd read at an offset of its own, with pread: every
    holder of the memfd shares its file offset."""

    def __init__(self, fd: int, closefd: bool) -> None:
        super().__init__()
        self._fd = fd
        self._closefd = closefd
        self._offset = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        count = os.preadv(self._fd, [buffer], self._offset)
        self._offset += count
        return count

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_CUR:
            offset += self._offset
        elif whence == os.SEEK_END:
            offset += os.fstat(self._fd).st_size
        self._offset = offset
        return offset

    def tell(self) -> int:
        return self._offset

    def close(self) -> None:
        if not self.closed and self._closefd:
            os.close(self._fd)
        super().close()


def read_payload(fd: int, keep_open: bool = False, size: int = -1) -> IO[bytes]:
    """The payload memfd as a file at the start of its work, never moving
    the memfd's offset (which its other holders share).  Up to 64 KiB (a
    launch's header and a small fn and args) it is read whole, at once; a
    larger one is read as it is unpickled, so that a large argument goes from the memfd into its
    unpickled object, not through a copy of the whole payload first.
    Closing it closes ``fd`` unless ``keep_open``: then the caller does,
    after its last read.  ``size``: the memfd's, where known (else an
    fstat asks)."""
    if size < 0:
        size = os.fstat(fd).st_size
    if size > READ_WHOLE:
        return io.BufferedReader(_PayloadFile(fd, not keep_open), buffer_size=READ_WHOLE)
    try:
        data = os.pread(fd, size, 0)
    finally:
        if not keep_open:
            os.close(fd)
    return io.BytesIO(data)
