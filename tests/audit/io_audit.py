"""The no-direct-I/O rule, enforced at run time: only ``preflight.sources`` touches the node.

An audit hook (``sys.addaudithook``, PEP 578) sees the interpreter's own I/O events while the
suite runs: files opened, directories listed, sockets created and used, programs run, native
libraries loaded and called, ioctls, first imports of the node libraries. For each such event it
finds the innermost stack frame whose module is preflight's (``preflight.*``: the built-in checks
as ``preflight.checks.*``, the probes as ``preflight.probes.*``; a ``--checks-dir`` module as
``preflight_site_checks_*``) and records a violation unless that module is a source or one of the
few modules in :data:`ALLOWED`, which read the tool's own data or the user's files, never the
node. Frames of the tests, of the standard library and of third-party packages are walked
through, and the walk ends at pytest's own frames, below which no preflight code runs: an event
with no preflight frame above them is not attributed. Reads the import machinery does for an
``import`` statement (``.py``/``.pyc`` files, ``sys.path`` listings), and ``linecache`` reading
preflight's own source for a traceback, are not the importing module's I/O and are skipped.

Where it runs: ``tests/conftest.py`` installs the hook in the pytest process for the whole
session and fails each test during which a violation happened, naming the module, the event and
its arguments. Every Python process a test starts with the test process's environment
(``preflight`` through ``run_cli``, ``measure``, the ansible runs) installs it too: conftest puts
this directory on ``PYTHONPATH``, where ``sitecustomize.py`` installs the hook when
``IO_AUDIT_LOG`` names a file, and the process appends its violations to that file, which conftest
reads after each test. A process started with an environment made from scratch, with ``-I`` or
``-E``, or as a user who cannot write the file is not audited. Like any run-time check, it sees
the code paths the suite runs, no others.

What an audit hook cannot see: CPython raises no event for ``os.stat``/``lstat``,
``os.path.exists``/``isfile``/``isdir``, ``Path.exists()``/``is_file()``/``stat()``/``resolve()``,
``os.readlink``, ``os.access``, ``os.statvfs``, ``resource.getrlimit``, ``pwd``/``grp`` look-ups or
``os.environ`` reads, nor for a module loaded through ``importlib.import_module`` (its loader
skips the ``import`` event). ``tests/test_no_direct_io.py`` keeps a small AST check for exactly
those, in check and probe modules only.

This module imports nothing beyond ``os``, ``sys`` and ``types``: it loads into every Python
process the suite starts, including the prolog runs whose imports tests count.
"""

from __future__ import annotations

import os
import sys
from types import FrameType

#: Events that touch the node (or could), as CPython 3.10/3.11 raise them from C or the stdlib
#: (https://docs.python.org/3/library/audit_events.html). Events 3.10 lacks never fire there.
NODE_EVENTS = frozenset({
    # files and directories ("open" covers builtins.open, io.open, os.open, os.fdopen, io.open_code,
    # so every file written too; shutil's copies, moves and tree walks raise these underneath)
    "open", "os.listdir", "os.scandir", "os.walk", "os.fwalk", "glob.glob", "glob.glob/2",
    "pathlib.Path.glob", "pathlib.Path.rglob", "os.getxattr",
    "mmap.__new__", "fcntl.ioctl", "fcntl.fcntl", "fcntl.flock", "fcntl.lockf",
    # changing the node's tree (metadata changes, chmod/chown/utime/xattrs, are left out: a test
    # copying a node root raises thousands, and changing a file's metadata starts from finding it)
    "os.mkdir", "os.remove", "os.rename", "os.symlink", "os.link", "os.truncate",
    # sockets (netlink, DNS, syslog, anything on the network)
    "socket.__new__", "socket.bind", "socket.connect", "socket.sendmsg", "socket.sendto",
    "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.gethostname",
    "socket.getnameinfo", "socket.getservbyname", "socket.getservbyport", "syslog.openlog", "syslog.syslog",
    # programs and processes
    "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "pty.spawn", "os.kill", "os.killpg",
    # native libraries (NVML, udev) and every call into them
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.call_function",
    # process limits that can be changed (getrlimit raises nothing: see the AST check)
    "resource.prlimit", "resource.setrlimit",
    # narrowed to NODE_LIBRARIES below
    "import",
})

#: Top-level names whose first import by a preflight module outside the sources is a violation.
NODE_LIBRARIES = frozenset({"pynvml", "pyroute2", "dns", "pyudev", "socket", "subprocess", "ctypes", "fcntl", "mmap"})

#: Modules that may do I/O, each with why: none of it is about the node. Each is here because a
#: run of the suite showed it doing so (preflight.snapshot and preflight.sourcetree are not:
#: the snapshot writes through preflight.sources.archive, and the checkout finder only stats).
ALLOWED = {
    "preflight.catalogue": "reads the packaged reference catalogue, and the references a site directory or plugin ships",
    "preflight.apart": "forks the child process the probes run in, so that a read stuck in the kernel holds that child and not the run",
    "preflight.cli.app": "the typer application: shell completion finds the user's shell in /proc (typer's shellingham), not the node",
    "preflight.catalogue_index": "reads the packaged catalogue's index (and writes it at build time)",
    "preflight.discovery": "lists and imports check modules (the package, plugins, --checks-dir)",
    "preflight.explain.reader": "reads the log files a user hands to explain",
    "preflight.explain.parallel": "forks the workers that scan those logs (multiprocessing's pipes, /dev/null)",
    "preflight.fleet": "writes the fleet output a user names, atomically (a temporary file renamed)",
    "preflight.fleet.load": "reads the node reports a user hands to fleet, in forked workers when many",
    "preflight.slurm": "the Slurm boundary, like a source: runs scontrol, writes the last-result file, sends syslog",
}

#: Packages whose modules are the node's sources.
SOURCE_PACKAGES = ("preflight.sources.",)

#: Module-name prefixes of preflight's own code (a --checks-dir module gets a private name).
PREFLIGHT_PREFIXES = ("preflight.", "preflight_site_checks_")

#: The import machinery: reads it does for an import statement are not the importer's I/O. Its
#: frozen modules are named _frozen_importlib(_external) until the importlib package is first
#: imported and renames them importlib._bootstrap(_external).
IMPORT_MACHINERY = ("importlib._bootstrap", "_frozen_importlib", "zipimport")
#: ... nor are reads of the program's own source for a traceback or a warning.
OWN_CODE_READERS = (*IMPORT_MACHINERY, "linecache", "tokenize")

#: The test harness: every test's stack starts with these frames, and preflight code is only ever
#: above them, so a walk that reaches one can stop (it saves walking pytest's ~40 frames for
#: every file a test itself copies).
HARNESS = ("_pytest.", "pluggy.", "pytest.")

#: Environment variable naming the file a child process appends its violations to.
LOG_VARIABLE = "IO_AUDIT_LOG"


class Violation:
    """One node-touching event raised on behalf of a module that may not touch the node."""

    __slots__ = ("module", "event", "arguments", "location")

    def __init__(self, module: str, event: str, arguments: str, location: str) -> None:
        self.module = module
        self.event = event
        self.arguments = arguments
        self.location = location  # file:line of the module's frame

    def __str__(self) -> str:
        return f"{self.module} ({self.location}): {self.event}{self.arguments}"

    def __repr__(self) -> str:
        return f"Violation({self})"

    def to_line(self) -> str:
        return "\t".join((self.module, self.event, self.arguments, self.location)).replace("\n", " ") + "\n"

    @classmethod
    def from_line(cls, line: str) -> Violation:
        module, event, arguments, location = line.rstrip("\n").split("\t", 3)
        return cls(module, event, arguments, location)


#: Every violation seen so far in this process, in order (appended from any thread).
violations: list[Violation] = []

_log_path: str | None = None

#: Every module-name prefix the walk stops at, in one tuple: most frames (the standard
#: library's, the tests') match none of them and cost a single startswith.
_NOTABLE = (*PREFLIGHT_PREFIXES, *HARNESS, *OWN_CODE_READERS)


def is_preflight(module: str) -> bool:
    return module == "preflight" or module.startswith(PREFLIGHT_PREFIXES)


def may_do_io(module: str) -> bool:
    return module.startswith(SOURCE_PACKAGES) or module in ALLOWED


def blamed_frame(frame: FrameType | None, event: str) -> FrameType | None:
    """The innermost preflight frame responsible for ``event`` raised in ``frame``, or None
    when the event is the import machinery's own work or no preflight code is on the stack.

    For ``import``, only the frame that runs the import statement counts: a standard library
    module that imports ``socket`` for itself is not preflight's doing."""
    importing = event == "import"
    while frame is not None:
        module = frame.f_globals.get("__name__") or ""
        if module.startswith(_NOTABLE) or module == "preflight":
            if is_preflight(module):
                return frame
            if module.startswith(HARNESS):
                return None
            if not importing or not module.startswith(IMPORT_MACHINERY):
                return None  # the import machinery, or linecache reading source for a traceback
        elif importing:
            return None
        frame = frame.f_back
    return None


def short(arguments: tuple[object, ...]) -> str:
    text = repr(arguments)
    return text if len(text) <= 300 else text[:297] + "..."


def audit(event: str, arguments: tuple[object, ...]) -> None:
    """The hook. Every event of the process comes through it, so the ones it ignores cost one
    set look-up; frames are walked only for node events."""
    if event not in NODE_EVENTS:
        return
    if event == "import":
        if str(arguments[0]).partition(".")[0] not in NODE_LIBRARIES:
            return
    elif event == "open" and arguments[0] == _log_path and _log_path is not None:
        return  # record()'s own write
    try:
        frame = blamed_frame(sys._getframe().f_back, event)  # None when C code raised it at top level
        if frame is not None:
            module = frame.f_globals["__name__"]
            if not may_do_io(module):
                record(Violation(module, event, short(arguments), f"{frame.f_code.co_filename}:{frame.f_lineno}"))
    except Exception as error:  # noqa: BLE001
        # Raising from a hook would abort the audited operation with a puzzling error; a bug
        # here must fail the test plainly instead.
        record(Violation("io_audit", "hook error", repr(error), ""))


def record(violation: Violation) -> None:
    violations.append(violation)
    if _log_path is None:
        return
    try:
        # Written at once: the CLI may leave through os._exit, which skips atexit handlers.
        fd = os.open(_log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, violation.to_line().encode("utf-8", "backslashreplace"))
        finally:
            os.close(fd)
    except OSError:
        pass  # a process run as another user cannot write the log; it goes unaudited


def read_log(path: str, offset: int) -> tuple[list[Violation], int]:
    """Violations child processes appended to ``path`` from byte ``offset`` on, and the new offset."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except FileNotFoundError:
        return [], offset
    complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next read
    lines = complete.decode("utf-8", "backslashreplace").splitlines()
    return [Violation.from_line(line) for line in lines], offset + len(complete)


_installed = False


def install(log_path: str | None = None) -> None:
    """Add the hook once per process (audit hooks cannot be removed). With ``log_path``,
    violations are also appended to that file (how a child process reports them)."""
    global _installed, _log_path
    _log_path = log_path
    if not _installed:
        sys.addaudithook(audit)
        _installed = True
