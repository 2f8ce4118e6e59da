"""A FUSE file system whose reads of chosen files never return: the kernel-level hang of a wedged
driver's sysfs file, or of a network mount that stopped answering, for the tests.

    python fuse_hang.py SOURCE MOUNTPOINT RELATIVE_PATH...

serves SOURCE read-only at MOUNTPOINT (in the foreground, single-threaded off: one stuck read must
not hold the others); reading any RELATIVE_PATH blocks forever. The reader then sleeps in the
kernel, in FUSE's request wait, where no Python-level timeout reaches it. Needs /dev/fuse, libfuse2
and fusepy (the test extra installs fusepy; ``.ci/run`` installs libfuse2).
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from typing import Any

from fuse import FUSE, FuseOSError, Operations  # type: ignore[import-not-found,import-untyped]


class HangingPassthrough(Operations):  # type: ignore[misc]
    def __init__(self, source: str, hanging: set[str]) -> None:
        self.source = source
        self.hanging = hanging
        self.never = threading.Event()

    def _path(self, path: str) -> str:
        return os.path.join(self.source, path.lstrip("/"))

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        try:
            status = os.lstat(self._path(path))
        except OSError as error:
            raise FuseOSError(error.errno) from None
        return {key: getattr(status, key) for key in ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_atime", "st_mtime", "st_ctime")}

    def readdir(self, path: str, fh: Any) -> list[str]:
        return [".", "..", *os.listdir(self._path(path))]

    def readlink(self, path: str) -> str:
        return os.readlink(self._path(path))

    def open(self, path: str, flags: int) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise FuseOSError(errno.EROFS)
        return 0

    def read(self, path: str, size: int, offset: int, fh: Any) -> bytes:
        if path.lstrip("/") in self.hanging:
            self.never.wait()  # never set: the reader waits in the kernel for good
        with open(self._path(path), "rb") as handle:
            handle.seek(offset)
            return handle.read(size)


def main(argv: list[str]) -> None:
    source, mountpoint, *hanging = argv
    FUSE(HangingPassthrough(source, set(hanging)), mountpoint, foreground=True, nothreads=False, ro=True, allow_other=True)


if __name__ == "__main__":
    main(sys.argv[1:])
