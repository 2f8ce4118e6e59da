"""What bounds a TCPStore server on this node: the listen backlog and the process's descriptor
limit (reference TORCH012).

Sources:

* ``/proc/sys/net/core/somaxconn``: the cap the kernel puts on every ``listen()`` backlog
  (listen(2); ``__sys_listen`` in ``net/socket.c`` lowers any larger backlog, -1 included, to it;
  4096 by default since Linux 5.4, 128 before).
  PyTorch's TCPStore servers, the libuv one and the legacy one, listen with a backlog of -1, which
  the kernel turns into this value (``torch/csrc/distributed/c10d/socket.cpp`` and
  ``TCPStoreLibUvBackend.cpp``), and ``TCPStore.cpp`` reads the same file to warn when it is
  below the number of workers.
* ``/proc/self/limits``, row ``Max open files`` (proc(5)), parsed as the memlock probe parses its
  own row (:func:`preflight.probes.memlock.parse_limits_row`): inside a job step it is the limit
  every rank, and so the rank or torchrun agent that hosts the store, starts with.

Both are read without subprocesses, so the probe is fit for the prolog.
"""

from __future__ import annotations

from msgspec import Struct

from preflight.probes.memlock import Limit, parse_limits_row
from preflight.registry import probe
from preflight.sources import NodeFS, SourceError
from preflight.units import is_number

SOMAXCONN = "/proc/sys/net/core/somaxconn"


PROCESS_LIMITS = "/proc/self/limits"


class StoreLimitsFacts(Struct, frozen=True):
    somaxconn: int | None  # /proc/sys/net/core/somaxconn; None when it could not be read
    somaxconn_problem: str  # why somaxconn is None ("path: missing", the read error); "" when read
    open_files: Limit | None  # /proc/self/limits "Max open files"; None when it could not be read
    open_files_problem: str  # why open_files is None; "" when read


def parse_somaxconn(text: str) -> int:
    """The sysctl's one decimal number; ValueError for anything else."""
    value = text.strip()
    if not is_number(value):
        raise ValueError(f"not a non-negative integer: {value[:40]!r}")
    return int(value)


def _read(fs: NodeFS, path: str) -> tuple[str | None, str]:
    """(text, "") when read, (None, reason) when missing or unreadable."""
    try:
        text = fs.read(path)
    except SourceError as error:
        return None, str(error)
    return (text, "") if text is not None else (None, f"{path}: missing")


@probe("store_limits")
def probe_store_limits(fs: NodeFS) -> StoreLimitsFacts:
    """The listen-backlog cap and the open-files limit a TCPStore server here would get."""
    somaxconn: int | None = None
    text, somaxconn_problem = _read(fs, SOMAXCONN)
    if text is not None:
        try:
            somaxconn = parse_somaxconn(text)
        except ValueError as error:
            somaxconn_problem = f"{SOMAXCONN}: {error}"
    open_files = None
    limits, open_files_problem = _read(fs, PROCESS_LIMITS)
    if limits is not None:
        open_files = parse_limits_row(limits, "Max open files", PROCESS_LIMITS)
        if open_files is None:
            open_files_problem = f"{PROCESS_LIMITS}: no readable 'Max open files' row"
    return StoreLimitsFacts(somaxconn, somaxconn_problem, open_files, open_files_problem)
