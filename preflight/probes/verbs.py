"""The verbs user space a process here would use (reference IB009): libibverbs and the provider
library each RDMA device needs.

NCCL opens libibverbs at run time (``src/misc/ibvsymbols.cc``: ``$NCCL_IBVERBS_LIB``, then
``libibverbs.so``, then ``libibverbs.so.1``); when none opens, or libibverbs lists no device, it
says so at INFO and runs over sockets. libibverbs lists a device only when a provider library for
its driver loads (rdma-core ``libibverbs/dynamic_driver.c``): the providers named by ``driver
<name>`` lines in ``/etc/libibverbs.d/*.driver`` (and ``$RDMAV_DRIVERS``), each opened as
``<libdir>/libibverbs/lib<name>-rdmav<ABI>.so`` and then as ``lib<name>-rdmav<ABI>.so`` on the
library search path. ``<ABI>`` is the provider ABI libibverbs was built with
(``IBVERBS_PABI_VERSION`` in its ``CMakeLists.txt``: 34 from rdma-core 34 to 56, then 57, 59, 64):
a provider of another rdma-core, left over from a MOFED install or bind-mounted from the host, has
another number in its name and is never opened. libibverbs exports the same number as its private symbol version
``IBVERBS_PRIVATE_<ABI>`` (``libibverbs/libibverbs.map.in``), so it is read from the library's
dynamic string table. A container image without rdma-core's providers, on a host whose devices are
all there, is the common way to lose them.

Sources: ``/sys/class/infiniband/<dev>/device/driver`` (the PCI driver, which names the provider
rdma-core pairs with it), the library directories NCCL's own probe reads
(``preflight.probes.nccl_libs.library_dirs``), the job's ``LD_LIBRARY_PATH`` and
``$CONDA_PREFIX/lib``, and ``/etc/libibverbs.d`` with, for a libibverbs installed under another
prefix (conda, Spack, a module), that prefix's ``etc/libibverbs.d`` (rdma-core's ``CONFIG_DIR`` is
``<sysconfdir>/libibverbs.d``). Where libraries could be found several ways, any one counts: a
missing piece is reported only when no place libibverbs or NCCL might look holds it. Only names
and links are read, and of one libibverbs its bytes, for the ABI number.
"""

from __future__ import annotations

import re

from msgspec import Struct

from preflight.probes.job import cgroup_step_of, in_job_process, library_path_dirs, parse_environ, task_step
from preflight.probes.nccl_libs import library_dirs
from preflight.probes.rdma import IB_CLASS
from preflight.probing import FactReader
from preflight.registry import probe
from preflight.sources import NodeFS, SourceError

CONFIG_DIR = "/etc/libibverbs.d"
LIBRARY_NAMES = ("libibverbs.so.1", "libibverbs.so")
#: The rdma-core provider for each kernel PCI driver of an RDMA device (rdma-core ``providers/``;
#: Intel's E810 and X722 are PCI functions of ice and i40e with irdma on top).
PROVIDER_OF_DRIVER = {
    "mlx5_core": "mlx5", "mlx4_core": "mlx4", "efa": "efa", "ice": "irdma", "i40e": "irdma",
    "irdma": "irdma", "bnxt_en": "bnxt_re", "qede": "qedr", "hns3": "hns", "cxgb4": "cxgb4",
    "ionic": "ionic", "mana": "mana", "erdma": "erdma", "vmw_pvrdma": "vmw_pvrdma",
    "hfi1": "hfi1verbs", "ib_qib": "ipathverbs", "be2net": "ocrdma", "ib_mthca": "mthca",
}
_PROVIDER_FILE = re.compile(r"^lib(\w+)-rdmav(\d{1,4})\.so$")
_PRIVATE_ABI = re.compile(rb"IBVERBS_PRIVATE_(\d{1,4})\x00")
MAX_LIBIBVERBS_BYTES = 8 << 20  # rdma-core's libibverbs.so.1 is about 130 KiB
_DRIVER_LINE = re.compile(r"^[ \t]*driver[ \t\n]+(\S+)")
MAX_CONFIG_FILES = 64  # a real /etc/libibverbs.d holds one file per provider (about 20)


class VerbsDevice(Struct, frozen=True):
    name: str
    driver: str | None  # the PCI driver; None for a virtual device (rxe, siw) or an unread link


class VerbsFacts(Struct, frozen=True):
    # Whether this process is one of the job's (a Slurm job, not a script slurmd runs): only then
    # is the user space read here the one the job's ranks load; a prolog reads the host's. None:
    # the environment could not be read (the reason in problems), so it may be the job's.
    job_view: bool | None
    rdmav_drivers: tuple[str, ...]  # $RDMAV_DRIVERS (or $IBV_DRIVERS): providers libibverbs loads too
    devices: tuple[VerbsDevice, ...]
    libraries: tuple[str, ...]  # libibverbs files found
    directories: tuple[str, ...]  # where they and the providers were looked for
    configured: tuple[str, ...] | None  # names from 'driver' lines; None: no /etc/libibverbs.d
    providers: tuple[tuple[str, int], ...]  # (name, ABI) of every lib<name>-rdmav<ABI>.so found
    problems: tuple[str, ...]
    # The provider ABI of the first libibverbs found (its IBVERBS_PRIVATE_<N>); None when it could
    # not be read or names none (a stub), and then any ABI counts.
    provider_abi: int | None = None


#: Facts of a process outside the job, for calls that do not gather them (unit tests).
VERBS_NOT_READ = VerbsFacts(False, (), (), (), (), None, (), ())


def parse_driver_lines(text: str) -> list[str]:
    """The provider names of a ``.driver`` file's ``driver <name>`` lines, as libibverbs reads them."""
    return [match.group(1) for line in text.splitlines() if (match := _DRIVER_LINE.match(line))]


def _devices(fs: NodeFS, reader: FactReader) -> list[VerbsDevice]:
    devices = []
    for name in sorted(reader.listing(IB_CLASS) or []):
        try:
            link = fs.readlink(f"{IB_CLASS}/{name}/device/driver")
        except SourceError as error:
            reader.problems.append(str(error))
            link = None
        devices.append(VerbsDevice(name, link.rstrip("/").rsplit("/", 1)[-1] if link else None))
    return devices


def install_prefix(library: str) -> str:
    """The prefix a library was installed under: ``/opt/rdma-core`` for
    ``/opt/rdma-core/lib64/libibverbs.so.1``, ``/usr`` for ``/usr/lib/x86_64-linux-gnu/...``."""
    parts = library.split("/")
    for index in range(len(parts) - 1, 0, -1):
        if parts[index].startswith("lib") and not parts[index].startswith("libibverbs"):
            return "/".join(parts[:index]) or "/"
    return library.rsplit("/", 1)[0]


def _configured(reader: FactReader, config_dirs: list[str]) -> tuple[str, ...] | None:
    """Provider names of every config directory a found libibverbs may read: the system's, and
    ``<prefix>/etc/libibverbs.d`` of one installed elsewhere (conda, Spack, a module); None when
    none of them exists."""
    found: list[str] = []
    seen = False
    for directory in config_dirs:
        names = reader.listing(directory)
        if not names and not reader.presence(directory):
            continue
        seen = True
        for name in sorted(names or [])[:MAX_CONFIG_FILES]:
            if name.endswith(".driver"):
                found += parse_driver_lines(reader.text(f"{directory}/{name}") or "")
    return tuple(dict.fromkeys(found)) if seen else None


def _providers(reader: FactReader, directories: list[str], wanted: set[str]) -> tuple[tuple[str, int], ...]:
    def found_in(folder: str) -> set[tuple[str, int]]:
        return {(match.group(1), int(match.group(2))) for name in reader.listing(folder) or [] if (match := _PROVIDER_FILE.match(name))}

    found = {provider for d in directories for provider in found_in(f"{d}/libibverbs")}
    if wanted - {name for name, _ in found}:
        # libibverbs' last resort is the library search path itself (older releases put providers there).
        found |= {provider for d in directories for provider in found_in(d)}
    return tuple(sorted(found))


def provider_abi(fs: NodeFS, library: str) -> int | None:
    """The provider ABI a libibverbs loads: the N of the ``IBVERBS_PRIVATE_<N>`` symbol version in
    its dynamic string table. None when the file cannot be read whole or names no single one."""
    try:
        data = fs.read_bytes(library, MAX_LIBIBVERBS_BYTES) or b""
    except SourceError:
        return None  # an unread library leaves the ABI open; its presence was read already
    found = {int(match.group(1)) for match in _PRIVATE_ABI.finditer(data)}
    return found.pop() if len(found) == 1 else None


@probe("verbs")
def probe_verbs(fs: NodeFS) -> VerbsFacts:
    """libibverbs and the providers the node's RDMA devices need, where a process here finds them."""
    reader = FactReader(fs)
    job_view: bool | None
    try:
        environ = parse_environ(fs.read_bytes("/proc/self/environ") or b"")
        job_view = in_job_process(environ) or task_step(cgroup_step_of(fs)[1])
    except SourceError as error:
        reader.problems.append(str(error))  # whatever is found missing is then unknown, not present
        environ, job_view = {}, None
    if job_view is False:  # a prolog, a health check, a shell: nothing here is judged (IB009)
        return VerbsFacts(False, (), (), (), (), None, (), tuple(reader.problems))
    devices = _devices(fs, reader)
    drivers = re.split(r"[:;]", environ.get("RDMAV_DRIVERS") or environ.get("IBV_DRIVERS") or "")
    if not devices:
        return VerbsFacts(job_view, (), (), (), (), None, (), tuple(reader.problems))
    job_dirs = library_path_dirs(environ)
    if environ.get("CONDA_PREFIX", "").startswith("/"):
        job_dirs.append(f"{environ['CONDA_PREFIX'].rstrip('/')}/lib")  # NCCL's conda build finds it by RPATH
    directories = list(dict.fromkeys([*job_dirs, *library_dirs(reader)]))
    libraries = [f"{d}/{name}" for d in directories for name in LIBRARY_NAMES if reader.presence(f"{d}/{name}")]
    ibverbs_lib = environ.get("NCCL_IBVERBS_LIB", "")  # NCCL tries it first
    if ibverbs_lib.startswith("/") and reader.presence(ibverbs_lib):
        libraries.insert(0, ibverbs_lib)
    wanted = {PROVIDER_OF_DRIVER[d.driver] for d in devices if d.driver in PROVIDER_OF_DRIVER}
    return VerbsFacts(
        job_view, tuple(name for name in drivers if name), tuple(devices), tuple(libraries), tuple(directories),
        _configured(reader, list(dict.fromkeys([CONFIG_DIR, *(f"{install_prefix(lib).rstrip('/')}/etc/libibverbs.d" for lib in libraries)]))),
        _providers(reader, directories, wanted), tuple(reader.problems), provider_abi(fs, libraries[0]) if libraries else None,
    )
