"""The NVLink fabric: NVLS (NVLink SHARP) multicast needs it configured and served (NVL006), and a
fabric manager restarted after boot can leave multicast state invalid (NVL004).

On HGX systems with NVSwitches on the baseboard the GPUs join the NVLink fabric only after the
fabric manager (``nv-fabricmanager``) has programmed the switches, and it keeps serving NVLS
multicast team setup requests while jobs run (its log shows "Team setup request" and "multicast
group N is allocated" lines, as in leptonai/gpud's fabricmanager.log test data). Until it has
done so, or once it is gone, peer-to-peer and NVLS multicast setup fail and NCCL either falls
back or, from 2.29, aborts. GB200/GB300 compute trays have no NVSwitch of their own: the fabric
is run from the NVLink switch trays, the compute tray's GPUs report their fabric through NVML
(cluster UUID and clique ID) and the fabric manager is not run there (it exits with
NV_WARN_NOTHING_TO_DO without NVSwitches).

Sources:

* ``/sys/bus/pci/devices/*``: NVSwitches are NVIDIA (0x10de) bridges of class 0x0680. (Grace's
  own PCIe root ports are NVIDIA bridges of class 0x0604 and are not NVSwitches.) On HGX/DGX
  B200 and later boards the switches are not on the host's PCI bus: Fabric Manager and NVLSM
  reach them through the baseboard's NVSwitch management functions, which the rdma probe finds
  by their VPD (``SMDL=SW_MNG``); the NVL checks count those too.
* NVML ``nvmlDeviceGetGpuFabricInfo`` per GPU: ``state`` (0 not supported, 1 not started,
  2 in progress, 3 completed), ``status`` (an NVML return code; 0 is success), ``clusterUuid``
  and ``cliqueId`` (non-zero on multi-node NVLink trays). Drivers before the fabric-info API
  answer ``NVML_ERROR_FUNCTION_NOT_FOUND`` or ``NOT_SUPPORTED``.
* The fabric manager without systemd (containers and prologs have no D-Bus): a process whose
  ``/proc/<pid>/comm`` is ``nv-fabricmanage`` (the kernel keeps 15 characters), or its command
  socket listening: TCP ``FM_CMD_PORT_NUMBER`` (default 6666, bound to ``FM_CMD_BIND_INTERFACE``,
  default 127.0.0.1) in ``/proc/net/tcp``, or ``FM_CMD_UNIX_SOCKET_PATH`` in ``/proc/net/unix``,
  as configured in ``/usr/share/nvidia/nvswitch/fabricmanager.cfg``. The process table counts
  as the host's only on positive evidence: PID 1 is the init system (``/proc/1/comm`` systemd or
  init), its environment (``/proc/1/environ``, root only) has no ``container=`` (the variable
  systemd-nspawn, LXC/LXD and podman give a container's init, and systemd's own test), and
  neither ``/run/systemd/container``, ``/.dockerenv``, ``/run/.containerenv`` nor a kubelet-managed
  ``/etc/hosts`` exists (``probing.container_marker``). A system
  container runs its own systemd as PID 1 in its own PID and network namespaces, where the
  host's fabric manager is invisible; there, or where any of these could not be read, a missing
  process proves nothing.
* Before any scan, the pid file a daemonised fabric manager writes (fabricmanager.cfg's
  ``PID_FILE_PATH``, by default ``/var/run/nvidia-fabricmanager/nv-fabricmanager.pid``, which
  the systemd unit names as ``PIDFile`` too) and that process's ``comm``: one file instead of
  every process's name, so a prolog can afford it. A missing, garbage or stale pid file falls
  back to the scan. No process is looked for where no NVSwitch is on the bus and every GPU's
  fabric is "not supported" (PCIe boards) or multi-node (GB200/GB300 trays).
* ``/proc/<pid>/stat`` field 22 (``starttime``, clock ticks after boot; USER_HZ is 100 on Linux):
  when the fabric manager started.
* The job's ``NCCL_NVLS_ENABLE``.
"""

from __future__ import annotations

from msgspec import Struct

from preflight.probes.sockets import TableError, parse_tcp_table
from preflight.probing import FactReader, container_marker
from preflight.registry import probe
from preflight.sources import NodeFS, SourceError
from preflight.sources.nvml import Nvml, NvmlError
from preflight.units import is_number

_NVSWITCH_CLASS = "0x0680"


_FABRIC_MANAGER_COMM = "nv-fabricmanag"


_HOST_INITS = ("systemd", "init")


FABRIC_MANAGER_CONFIG = "/usr/share/nvidia/nvswitch/fabricmanager.cfg"


DEFAULT_FM_PORT = 6666  # FM_CMD_PORT_NUMBER (nv_fm_types.h)


DEFAULT_PID_FILE = "/var/run/nvidia-fabricmanager/nv-fabricmanager.pid"


USER_HZ = 100  # clock ticks per second of /proc/<pid>/stat times on Linux


class GpuFabric(Struct, frozen=True):
    index: int
    state: int | None
    status: int | None
    cluster_uuid: str | None  # hex of clusterUuid; None when all zero (no multi-node fabric)
    clique_id: int | None
    error: str  # NVML error code of the fabric query, "" when it answered


class FabricManager(Struct, frozen=True):
    """What the node shows of a running fabric manager."""

    pids: tuple[int, ...]  # processes named nv-fabricmanage
    host_view: bool | None  # the host's process table (see the module docstring); None: not known
    pid1: str | None  # /proc/1/comm
    listening: str | None  # "127.0.0.1:6666 (/proc/net/tcp:3)" or the unix socket path
    started_after_boot_s: float | None  # of the first pid, from /proc/<pid>/stat
    problems: tuple[str, ...]
    not_host: str = ""  # why host_view is not True: "PID 1 is pause, not the host's init", ...
    # why no process was looked for, "" where it was: a node whose GPUs join no NVSwitch fabric
    # runs no fabric manager, and scanning every process's name costs a prolog milliseconds
    not_looked_for: str = ""

    @property
    def running(self) -> bool:
        return bool(self.pids) or self.listening is not None


class FabricFacts(Struct, frozen=True):
    nvswitches: tuple[str, ...]
    gpus: tuple[GpuFabric, ...]
    nvml_error: str
    fabric_manager: FabricManager
    problems: tuple[str, ...]
    nvswitch_problem: str = ""  # why some PCI function might be an NVSwitch not counted, "" if none
    nvidia_functions: int = 0  # NVIDIA PCI functions (GPUs, NVSwitches) on /sys/bus/pci/devices

    @property
    def multi_node_tray(self) -> bool:
        """A GB200/GB300-style compute tray: no NVSwitch here, GPUs in a multi-node NVLink fabric."""
        return not self.nvswitches and any(gpu.cluster_uuid is not None for gpu in self.gpus)


def _uuid(value: object) -> str | None:
    if isinstance(value, list) and all(type(part) is int for part in value) and any(value):
        return "".join(f"{part & 0xFF:02x}" for part in value)
    return None


def _gpu_fabric(nvml: Nvml, index: int) -> GpuFabric:
    try:
        info = nvml.call("nvmlDeviceGetGpuFabricInfo", index)
    except NvmlError as failure:
        return GpuFabric(index, None, None, None, None, failure.code)
    if not isinstance(info, dict):
        return GpuFabric(index, None, None, None, None, f"unexpected answer {info!r}")
    state, status, clique = info.get("state"), info.get("status"), info.get("cliqueId")
    return GpuFabric(
        index,
        state if type(state) is int else None,
        status if type(status) is int else None,
        _uuid(info.get("clusterUuid")),
        clique if type(clique) is int else None,
        "",
    )


def _fm_settings(text: str) -> dict[str, str]:
    values = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.lstrip().startswith("#"):
            values[key.strip()] = value.strip()
    return values


def parse_fm_config(text: str) -> tuple[int, str, str]:
    """(port, bind address, unix socket path) from fabricmanager.cfg ``KEY=value`` lines."""
    values = _fm_settings(text)
    try:
        port = int(values.get("FM_CMD_PORT_NUMBER", DEFAULT_FM_PORT))
    except ValueError:
        port = DEFAULT_FM_PORT
    return port, values.get("FM_CMD_BIND_INTERFACE", "127.0.0.1"), values.get("FM_CMD_UNIX_SOCKET_PATH", "")


def fm_pid_file(text: str) -> str:
    """The pid file a daemonised fabric manager writes: fabricmanager.cfg's ``PID_FILE_PATH``,
    by default /var/run/nvidia-fabricmanager/nv-fabricmanager.pid (which its systemd unit names
    as PIDFile too)."""
    path = _fm_settings(text).get("PID_FILE_PATH", "")
    return path if path.startswith("/") else DEFAULT_PID_FILE


def parse_start_after_boot(stat: str) -> float:
    """Seconds after boot a process started, from ``/proc/<pid>/stat`` (field 22, after the
    parenthesised command name, which may itself contain spaces and parentheses)."""
    fields = stat.rpartition(")")[2].split()
    if len(fields) < 20:
        raise ValueError("fewer than 22 fields")
    return int(fields[19]) / USER_HZ


def _listening(reader: FactReader, config: str) -> str | None:
    port, _, unix_path = parse_fm_config(config)
    if unix_path:
        for line in (reader.text("/proc/net/unix") or "").splitlines()[1:]:
            if line.split()[-1:] == [unix_path]:
                return unix_path
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        text = reader.text(table)
        if not text:
            continue
        try:
            parsed = parse_tcp_table(text, table)
        except TableError:
            reader.problems.append(f"{table}: not a TCP table")
            continue
        for socket in parsed.listening:
            if socket.port == port:
                return f"{socket.address}:{socket.port} ({socket.source})"
    return None


def _is_fabric_manager(reader: FactReader, pid: int) -> bool:
    comm = reader.text(f"/proc/{pid}/comm")
    return comm is not None and comm.strip().startswith(_FABRIC_MANAGER_COMM)


def _pid_file_process(fs: NodeFS, config: str) -> int | None:
    """The running fabric manager its pid file names, None where the file is missing, garbage or
    stale. A prolog reads this one file instead of every process's name; read quietly, since
    the scan that follows a miss decides."""
    path = fm_pid_file(config)
    paths = (path, "/run/" + path[len("/var/run/"):]) if path.startswith("/var/run/") else (path,)
    for candidate in paths:
        try:
            text = fs.read(candidate, max_bytes=64)
        except SourceError:
            return None
        if text is not None:
            pid = text.strip()
            if not is_number(pid) or int(pid) <= 0:
                return None
            return int(pid) if _is_fabric_manager(FactReader(fs), int(pid)) else None
    return None


def _fabric_manager(reader: FactReader) -> FabricManager:
    config = reader.text(FABRIC_MANAGER_CONFIG) or ""
    pid1 = reader.text("/proc/1/comm")
    recorded = _pid_file_process(reader.fs, config)
    if recorded is not None:
        found, listening = [recorded], None
    else:
        # Unlisted /proc stays in problems: the checks cannot tell whether the manager runs.
        pids = sorted(int(name) for name in reader.listing("/proc") or [] if is_number(name))
        if not pids:
            return FabricManager((), None, None, _listening(reader, config), None, tuple(reader.problems), "/proc could not be scanned")
        found = [pid for pid in pids if _is_fabric_manager(reader, pid)]
        listening = _listening(reader, config)
    started = None
    if found:
        stat = reader.text(f"/proc/{found[0]}/stat")
        try:
            started = parse_start_after_boot(stat) if stat is not None else None
        except ValueError as error:
            reader.problems.append(f"/proc/{found[0]}/stat: {error}")
    name = pid1.strip() if pid1 is not None else None
    host, not_host = _host_view(reader, name)
    return FabricManager(tuple(found), host, name, listening, started, tuple(reader.problems), not_host)


def _host_view(reader: FactReader, pid1: str | None) -> tuple[bool | None, str]:
    """Whether this /proc is the host's process table, and why not: only on positive evidence."""
    if pid1 is None:
        return None, "PID 1 is unreadable (/proc/1/comm)"
    if pid1 not in _HOST_INITS:
        return False, f"PID 1 is {pid1}, not the host's init"
    try:
        environ = reader.fs.read_bytes("/proc/1/environ")
    except SourceError as error:
        return None, f"/proc/1/environ is unreadable ({error.reason}), so a container's own {pid1} cannot be ruled out"
    if environ is None:
        return None, f"/proc/1/environ is missing, so a container's own {pid1} cannot be ruled out"
    if any(item.startswith(b"container=") for item in environ.split(b"\0")):
        return False, f"PID 1's environment has container=: {pid1} is a container's own init"
    marker = container_marker(reader)
    if marker is None:
        return None, f"whether this is a container could not be read ({reader.problems[-1]})"
    if marker:
        return False, f"{marker} exists: {pid1} is a container's own init"
    return True, ""


@probe("fabric", gather_in=("full",))
def probe_fabric(fs: NodeFS, nvml: Nvml) -> FabricFacts:
    """NVSwitches on the bus, each GPU's fabric state, and whether a fabric manager runs."""
    reader = FactReader(fs)
    nvidia = [
        bdf
        for bdf in reader.listing("/sys/bus/pci/devices") or []  # unlisted: nvswitch_problem
        if (reader.text(f"/sys/bus/pci/devices/{bdf}/vendor") or "").strip() == "0x10de"
    ]
    nvswitches = tuple(bdf for bdf in nvidia if (reader.text(f"/sys/bus/pci/devices/{bdf}/class") or "").strip().startswith(_NVSWITCH_CLASS))
    unclassified = next((p for p in reader.problems if p.startswith("/sys/bus/pci/devices")), "")
    try:
        count = nvml.call("nvmlDeviceGetCount")
    except NvmlError as error:
        return FabricFacts(nvswitches, (), error.code, _manager_without_nvml(fs, nvswitches), tuple(reader.problems), unclassified, len(nvidia))
    if not isinstance(count, int) or count < 0:  # a damaged recording, not "no GPUs"
        return FabricFacts(nvswitches, (), "NVML_UNEXPECTED_ANSWER", _manager_without_nvml(fs, nvswitches), tuple(reader.problems), unclassified, len(nvidia))
    gpus = tuple(_gpu_fabric(nvml, index) for index in range(count))
    outside = _outside_any_switch_fabric(nvswitches, gpus)
    manager = FabricManager((), None, None, None, None, (), not_looked_for=outside) if outside else _fabric_manager(FactReader(fs))
    return FabricFacts(nvswitches, gpus, "", manager, tuple(reader.problems), unclassified, len(nvidia))


def _manager_without_nvml(fs: NodeFS, nvswitches: tuple[str, ...]) -> FabricManager:
    """Without NVML, NVL006 judges nothing and NVL004 only NVSwitches on the bus: elsewhere (a
    host without GPUs, a broken driver on a PCIe board) no process is looked for."""
    if nvswitches:
        return _fabric_manager(FactReader(fs))
    return FabricManager((), None, None, None, None, (), not_looked_for="NVML is unavailable and no NVSwitch is on the PCI bus")


def _outside_any_switch_fabric(nvswitches: tuple[str, ...], gpus: tuple[GpuFabric, ...]) -> str:
    """Why this node's GPUs need no fabric manager here, or "" where one may run: no NVSwitch on
    the bus and every GPU's fabric "not supported" (PCIe boards), or in a multi-node fabric (GB200
    and GB300 trays, whose fabric manager runs on the NVLink switch trays). Boards whose switches
    are off the bus (HGX B200) report a fabric state of their own, so they are looked at."""
    if nvswitches or not gpus or any(gpu.error for gpu in gpus):
        return ""
    if all(gpu.state == 0 for gpu in gpus):
        return "no NVSwitch on the PCI bus and every GPU's NVLink fabric is 'not supported'"
    if all(gpu.cluster_uuid is not None for gpu in gpus):
        return "the GPUs are in a multi-node NVLink fabric, whose fabric manager runs on the switch trays"
    return ""
