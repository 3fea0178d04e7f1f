"""Opening a checkpoint's files: regular files only, every size compared with its bound before a byte is read.

A checkpoint folder comes from whoever could write to it, and a name in it
can be a FIFO (``open`` blocks until a writer comes: the resume hangs), a
device (``/dev/zero`` reads forever), a directory, or a sparse file of
terabytes that costs nothing on disk and its full size in memory when read
whole. So every file a reader opens (``.metadata``, ``.digests``, the data
files) is opened here: with ``O_NONBLOCK`` (a FIFO does not block the open),
then ``fstat`` on the descriptor itself (no race with a rename), refusing
anything but a regular file by name. A symbolic link to a regular file is
followed (copies of checkpoints made with links load); one to anything else
is refused for what it points to. Reads of a whole file (``read_whole``)
compare ``fstat``'s size with the caller's bound first and then read exactly
that many bytes.

fsspec URLs (``s3://``, ...) hold objects, not special files: their size
comes from the store's listing and is bounded the same way.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
from collections.abc import Iterator
from typing import Any, BinaryIO

from torch.distributed.checkpoint.filesystem import FileSystem as LocalFileSystem

from gefen_titan.checkpoint.errors import GefenCheckpointError

__all__ = ["NotARegularFileError", "TooLargeError", "open_regular", "open_stream", "open_sized", "read_whole",
           "regular_size"]


class NotARegularFileError(GefenCheckpointError, OSError):
    """A name of a checkpoint folder that is no regular file (a FIFO, a device, a directory, a socket).
    An OSError too: a caller that reports unreadable files reports this one, with its message."""

    check = "regular files"

    def __init__(self, path: str, what: str) -> None:
        self.path, self.what = path, what
        super().__init__(f"checkpoint file {path} is {what}, not a regular file: refused without reading it (no save "
                         "writes one; a reader would block or read without end). Replace it with the file from a "
                         "copy of the checkpoint, or resume from another step. Nothing was loaded.")

    def __reduce__(self) -> tuple:  # pickled to every rank by DCP's gather: keep the fields
        return type(self), (self.path, self.what), self.__dict__


class TooLargeError(GefenCheckpointError):
    """A checkpoint file larger than the format allows it to be (or than its save recorded)."""

    check = "regular files"

    def __init__(self, path: str, size: int, bound: int, why: str) -> None:
        self.path, self.size, self.bound, self.why = path, size, bound, why
        super().__init__(f"checkpoint file {path} is {size:,} bytes, and {why} allows at most {bound:,}: refused "
                         "before reading it. Restore it from a copy of the checkpoint, or resume from another "
                         "step. Nothing was loaded.")

    def __reduce__(self) -> tuple:
        return type(self), (self.path, self.size, self.bound, self.why), self.__dict__


_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike) -> tuple[BinaryIO, int]:
    """(a binary read stream, its size) of a local regular file; ``NotARegularFileError`` for anything
    else, OSError (``FileNotFoundError``, ...) as ``open`` raises it."""
    path = os.fspath(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFileError(path, _kind(st.st_mode))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def open_stream(fs: Any, path: Any) -> BinaryIO:
    """A read stream (a context manager) on a file through a DCP reader's ``fs``: ``open_regular`` for
    DCP's local file system; fsspec's stores hold objects, which its own ``open`` reads."""
    if isinstance(fs, LocalFileSystem):
        return open_regular(path)[0]
    return fs.fs.open(path, "rb")


@contextlib.contextmanager
def open_sized(fs: Any, path: Any) -> Iterator[tuple[BinaryIO, int]]:
    """(stream, size) of a file through a DCP reader's ``fs`` (``open_stream``); the size is the file
    system's (``fstat``), taken before any byte is read."""
    with open_stream(fs, path) as f:
        size = f.seek(0, io.SEEK_END)
        f.seek(0)
        yield f, size


def regular_size(path: str | os.PathLike) -> int | None:
    """A local file's size if it is a regular file (followed through links), None if nothing is there;
    ``NotARegularFileError`` for anything else (checked without opening it)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise NotARegularFileError(os.fspath(path), _kind(st.st_mode))
    return st.st_size


def read_whole(stream: Any, size: int, bound: int, path: str, why: str) -> bytes:
    """Exactly ``size`` bytes of an opened file (fewer if it was cut short since: the caller's digest or
    parse refuses them), after ``TooLargeError`` if ``size`` exceeds ``bound``."""
    if size > bound:
        raise TooLargeError(path, size, bound, why)
    return stream.read(size)
