"""Build ``examples/nodes/hgx-h100``: a recorded root of an 8-GPU, 8-NIC HGX H100 node.

The tree is modelled on real kernel formats (sysfs attribute text with trailing newlines, the
``/proc/<pid>/limits`` table, ``/proc/net/fib_trie``...) with the layout of an HGX H100 board:
eight H100 SXM GPUs and eight ConnectX-7 NDR HCAs behind four PCIe switches, four NVSwitches,
one Ethernet management port and an idle ``docker0`` bridge. NVML and DNS answers replay from
``.preflight/``. Host names and addresses are invented.

Planted misconfigurations (what ``preflight node --root`` finds):

* slurmd runs with memlock 8 MiB and slurm.conf propagates MEMLOCK (MEM001);
* ``/etc/nccl.conf`` sets NCCL_BUFFSIZE to 256 MiB, more than the 8 MiB limit (MEM002);
* proprietary driver and no nvidia-peermem: no GPUDirect RDMA path (GDR001);
* ``/etc/nccl.conf`` enables GDRCopy, but gdrdrv is not loaded (GDR002);
* ``/etc/hosts`` maps the host name to 127.0.1.1 before its real address (DNS001);
* the PCIe switch above GPU 3 and mlx5_3 (0000:5c:00.0) has ACS P2P redirect on (PCI001);
* NCCL 2.21.5 (system package and wheel) retries a failed connect on the same socket (SOCK002,
  a warning: fixed in 2.24.3).

Healthy on purpose: the peer gpu018 and the nameservers (DNS001), the TCP sockets and the
ephemeral port range (SOCK001, SOCK005); see ``name_service_and_sockets``.

Run ``python examples/nodes/build_hgx_h100.py`` to rebuild the tree after changing this file
(``... build_hgx_h100.py DIRECTORY`` writes ``DIRECTORY/hgx-h100`` instead).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
HOSTNAME = "gpu017"
SLURMD_PID = 2187
FABRIC_MANAGER_PID = 1843
NCCL_VERSION = "2.21.5"
DRIVER = "550.54.15"
DRIVER_CUDA = 12040  # the R550 driver supports CUDA 12.4 (NVML encodes 1000 * major + 10 * minor)
# (GPU bus, NIC bus, PCIe switch downstream bus, root port) per GPU/NIC pair, as on HGX H100.
PAIRS = [
    ("18", "1a", "17", "15"), ("2a", "2c", "29", "27"), ("3a", "3c", "39", "37"), ("5d", "5f", "5c", "5a"),
    ("9a", "9c", "99", "97"), ("ab", "ad", "aa", "a8"), ("ba", "bc", "b9", "b7"), ("db", "dd", "da", "d8"),
]
NVSWITCHES = ["0000:05:00.0", "0000:06:00.0", "0000:07:00.0", "0000:08:00.0"]
LIMITS_ROWS = [
    ("Max cpu time", "unlimited", "unlimited", "seconds"),
    ("Max file size", "unlimited", "unlimited", "bytes"),
    ("Max data size", "unlimited", "unlimited", "bytes"),
    ("Max stack size", "8388608", "unlimited", "bytes"),
    ("Max core file size", "0", "unlimited", "bytes"),
    ("Max resident set", "unlimited", "unlimited", "bytes"),
    ("Max processes", "2062690", "2062690", "processes"),
    ("Max open files", "131072", "131072", "files"),
    ("Max locked memory", "8388608", "8388608", "bytes"),
    ("Max address space", "unlimited", "unlimited", "bytes"),
    ("Max file locks", "unlimited", "unlimited", "locks"),
    ("Max pending signals", "2062690", "2062690", "signals"),
    ("Max msgqueue size", "819200", "819200", "bytes"),
    ("Max nice priority", "0", "0", ""),
    ("Max realtime priority", "0", "0", ""),
    ("Max realtime timeout", "unlimited", "unlimited", "us"),
]


def limits_table(rows: list[tuple[str, str, str, str]]) -> str:
    """The fixed-width layout of proc_pid_limits() in fs/proc/base.c, trailing spaces included."""
    lines = [f"{'Limit':<25} {'Soft Limit':<20} {'Hard Limit':<20} {'Units':<10} "]
    lines += [f"{name:<25} {soft:<20} {hard:<20} {units:<10} " for name, soft, hard, units in rows]
    return "\n".join(lines) + "\n"


def write(root: str, path: str, text: str | bytes) -> None:
    full = os.path.join(root, path.lstrip("/"))
    os.makedirs(os.path.dirname(full), exist_ok=True)
    mode = "wb" if isinstance(text, bytes) else "w"
    with open(full, mode) as handle:
        handle.write(text)


def link(root: str, path: str, target: str) -> None:
    full = os.path.join(root, path.lstrip("/"))
    os.makedirs(os.path.dirname(full), exist_ok=True)
    os.symlink(target, full)


def pci_device(root: str, bdf: str, parent: str, vendor: str, device: str, klass: str, numa: int,
               link_speed: tuple[str, str] | None = None) -> str:
    """A PCI function under /sys/devices with a /sys/bus/pci/devices link; returns its path.
    ``link_speed`` is (current, max) link speed of a x16 PCIe function, as pci-sysfs.c prints them."""
    path = f"/sys/devices/{parent}/{bdf}"
    # PCIe Gen5 x16 links (H100 SXM, ConnectX-7, the switches); NVSwitches left without them.
    speed = (("max_link_speed", "32.0 GT/s PCIe"), ("max_link_width", "16")) if klass != "0x068000" else ()
    for name, value in (("vendor", vendor), ("device", device), ("class", klass), ("numa_node", str(numa)), *speed):
        write(root, f"{path}/{name}", value + "\n")
    if link_speed is not None:
        for name, value in (("current_link_speed", link_speed[0]), ("max_link_speed", link_speed[1]), ("current_link_width", "16"), ("max_link_width", "16")):
            write(root, f"{path}/{name}", value + "\n")
    link(root, f"/sys/bus/pci/devices/{bdf}", f"../../..{path[len('/sys'):]}")
    return path


ACS_REDIRECT_SWITCH = "5c"  # the planted PCI001 bridge
ACS_ON = 0x001D  # SrcValid+ ReqRedir+ CmpltRedir+ UpstreamFwd+, as firmware with ACS enabled leaves it


def bridge_config(acs_control: int) -> bytes:
    """4 KiB config space of a bridge: type-1 header, AER at 0x100, ACS at 0x148 (as lspci -xxxx shows)."""
    data = bytearray(4096)
    data[0x0E] = 0x01  # header type 1 (bridge)
    data[0x100:0x104] = (0x0001 | 1 << 16 | 0x148 << 20).to_bytes(4, "little")
    data[0x148:0x14C] = (0x000D | 1 << 16).to_bytes(4, "little")
    data[0x14C:0x14E] = (0x005F).to_bytes(2, "little")  # SV TB RR CR UF DT supported
    data[0x14E:0x150] = acs_control.to_bytes(2, "little")
    return bytes(data)


def rdma_device_nodes(root: str) -> None:
    """What the verbs stack adds to the HCAs above: each RDMA device's link to its PCI function,
    the ib_uverbs class, and the /dev/infiniband nodes the job opens. Git keeps no character
    devices or owners, so the nodes are placeholders and their stat is in .preflight/devices.json."""
    nodes = {}
    for index, (_, nic, switch, port) in enumerate(PAIRS):
        nic_path = f"/sys/devices/pci0000:{port}/0000:{port}:01.0/0000:{switch}:00.0/0000:{nic}:00.0"
        link(root, f"{nic_path}/infiniband/mlx5_{index}/device", f"../../../0000:{nic}:00.0")
        verbs = f"{nic_path}/infiniband_verbs/uverbs{index}"
        link(root, f"/sys/class/infiniband_verbs/uverbs{index}", f"../../devices{verbs[len('/sys/devices'):]}")
        for name, value in (("ibdev", f"mlx5_{index}"), ("abi_version", "1"), ("dev", f"231:{192 + index}")):
            write(root, f"{verbs}/{name}", value + "\n")
        nodes[f"/dev/infiniband/uverbs{index}"] = {"type": "char", "mode": "0666", "uid": 0, "gid": 0}
    write(root, "/sys/class/infiniband_verbs/abi_version", "6\n")
    write(root, "/sys/module/ib_uverbs/refcnt", "4\n")  # every loaded module has its /sys/module entry
    nodes["/dev/infiniband/rdma_cm"] = {"type": "char", "mode": "0666", "uid": 0, "gid": 0}
    for path in nodes:
        write(root, path, "")
    write(root, "/.preflight/devices.json", json.dumps({"format": "preflight-devices/1", "nodes": nodes}, indent=1) + "\n")


def build(root: str) -> None:
    if os.path.exists(root):
        shutil.rmtree(root)
    os.makedirs(root)
    nvml_devices: dict[str, dict[str, object]] = {
        "name": {}, "pci": {}, "uuid": {}, "bar1": {}, "fabric": {}, "rows": {}, "persistence": {}, "ecc_mode": {}, "ecc_volatile": {},
        "clock_reasons": {}, "pages_pending": {},
    }
    for index, (gpu, nic, switch, port) in enumerate(PAIRS):
        numa = 0 if index < 4 else 1
        domain_root = f"pci0000:{port}"
        bridge = pci_device(root, f"0000:{port}:01.0", domain_root, "0x8086", "0x352a", "0x060400", numa)
        switch_up = pci_device(root, f"0000:{switch}:00.0", bridge[len('/sys/devices/'):], "0x1000", "0xc030", "0x060400", numa)
        write(root, f"{bridge}/config", bridge_config(0))
        write(root, f"{switch_up}/config", bridge_config(ACS_ON if switch == ACS_REDIRECT_SWITCH else 0))
        parent = switch_up[len("/sys/devices/"):]
        gpu_bdf, nic_bdf = f"0000:{gpu}:00.0", f"0000:{nic}:00.0"
        # An idle H100 keeps its x16 width but drops the link to 2.5 GT/s until work arrives.
        pci_device(root, gpu_bdf, parent, "0x10de", "0x2330", "0x030200", numa, link_speed=("2.5 GT/s PCIe", "32.0 GT/s PCIe"))
        write(root, f"/proc/driver/nvidia/gpus/{gpu_bdf}/information", f"Model: \t\t NVIDIA H100 80GB HBM3\nBus Location: \t {gpu_bdf}\n")
        nic_path = pci_device(root, nic_bdf, parent, "0x15b3", "0x1021", "0x020700", numa, link_speed=("32.0 GT/s PCIe", "32.0 GT/s PCIe"))
        dev = f"mlx5_{index}"
        ib = f"{nic_path}/infiniband/{dev}"
        link(root, f"/sys/class/infiniband/{dev}", f"../../devices{ib[len('/sys/devices'):]}")
        for name, value in (
            ("node_type", "1: CA"), ("fw_ver", "28.39.1002"), ("hca_type", "MT4129"),
            ("node_guid", f"a088:c203:00{index:02x}:1e2c"), ("board_id", "MT_0000000838"),
            ("ports/1/state", "4: ACTIVE"), ("ports/1/phys_state", "5: LinkUp"),
            ("ports/1/rate", "400 Gb/sec (4X NDR)"), ("ports/1/link_layer", "InfiniBand"),
            ("ports/1/lid", f"0x{0x41 + index:x}"), ("ports/1/sm_lid", "0x1"),
            ("ports/1/counters/link_downed", "0"), ("ports/1/counters/link_error_recovery", "0"),
        ):
            write(root, f"{ib}/{name}", value + "\n")
        netdev = f"ibp{int(nic, 16)}s0"
        net = f"{nic_path}/net/{netdev}"
        link(root, f"/sys/class/net/{netdev}", f"../../devices{net[len('/sys/devices'):]}")
        for name, value in (("ifindex", str(4 + index)), ("mtu", "4092"), ("operstate", "up"), ("type", "32"), ("mode", "datagram"),
                            ("address", f"00:00:10:29:fe:80:00:00:00:00:00:00:a0:88:c2:03:00:{index:02x}:1e:2c"),
                            ("uevent", f"INTERFACE={netdev}\nIFINDEX={4 + index}\n")):
            write(root, f"{net}/{name}", value + "\n")
        # H100 SXM: a 16 MiB 64-bit register BAR (region 0, two registers) and the 128 GiB BAR1
        # aperture as region 2; start end flags per line, as /sys/bus/pci/devices/<bdf>/resource.
        base = 0x2000_0000_0000 + index * 0x40_0000_0000
        regions = [(0xE000_0000 + index * 0x0200_0000, 0x0100_0000, 0x140204), (0, 0, 0), (base, 128 << 30, 0x14220C)]
        write(root, f"/sys/devices/{parent}/{gpu_bdf}/resource",
              "".join(f"0x{start:016x} 0x{(start + size - 1) if size else 0:016x} 0x{flags:016x}\n" for start, size, flags in regions)
              + "0x0000000000000000 0x0000000000000000 0x0000000000000000\n" * 10)
        nvml_devices["bar1"][str(index)] = {"result": {"bar1Total": 128 << 30, "bar1Free": (128 << 30) - (2 << 20), "bar1Used": 2 << 20}}
        nvml_devices["fabric"][str(index)] = {"result": {"clusterUuid": [0] * 16, "status": 0, "cliqueId": 0, "state": 3}}
        nvml_devices["rows"][str(index)] = {"result": [0, 0, 0, 0]}  # correctable, uncorrectable, pending, failure
        nvml_devices["persistence"][str(index)] = {"result": 1}  # nvidia-persistenced keeps the GPUs initialised
        nvml_devices["ecc_mode"][str(index)] = {"result": [1, 1]}  # current, pending
        nvml_devices["clock_reasons"][str(index)] = {"result": 0x1}  # GpuIdle: waiting for a job, nothing holds it back
        # Hopper remaps rows instead of retiring pages: nvidia-smi prints pending_retirement N/A.
        nvml_devices["pages_pending"][str(index)] = {"error": "NVML_ERROR_NOT_SUPPORTED"}
        # nvmlDeviceGetTotalEccErrors(UNCORRECTED=1, VOLATILE=0): extra arguments join the key
        nvml_devices["ecc_volatile"][f"{index}/1/0"] = {"result": 0}
        nvml_devices["name"][str(index)] = {"result": "NVIDIA H100 80GB HBM3"}
        nvml_devices["pci"][str(index)] = {"result": {"busId": f"0000{gpu_bdf.upper()}", "domain": 0, "bus": int(gpu, 16), "device": 0}}
        nvml_devices["uuid"][str(index)] = {"result": f"GPU-5f1c7e2a-0c3b-4d7e-9a61-00000000000{index}"}
    rdma_device_nodes(root)
    for index, bdf in enumerate(NVSWITCHES):
        pci_device(root, bdf, "pci0000:00", "0x10de", "0x22a3", "0x068000", 0)
    # Management Ethernet and an idle docker bridge.
    for name, index, mtu, state, devtype, mac in (
        ("lo", 1, "65536", "unknown", "", "00:00:00:00:00:00"),
        ("eno1", 2, "1500", "up", "", "7c:c2:55:1a:2b:3c"),
        ("docker0", 3, "1500", "down", "bridge", "02:42:8f:11:22:33"),
    ):
        base = f"/sys/devices/virtual/net/{name}" if name != "eno1" else "/sys/devices/pci0000:00/0000:00:1f.6/net/eno1"
        link(root, f"/sys/class/net/{name}", f"../..{base[len('/sys'):]}")
        arphrd = "772" if name == "lo" else "1"
        uevent = f"DEVTYPE={devtype}\nINTERFACE={name}\n" if devtype else f"INTERFACE={name}\n"
        for attr, value in (("ifindex", str(index)), ("mtu", mtu), ("operstate", state), ("type", arphrd), ("address", mac), ("uevent", uevent)):
            write(root, f"{base}/{attr}", value + ("" if value.endswith("\n") else "\n"))
    write(root, "/proc/net/if_inet6",
          "00000000000000000000000000000001 01 80 10 80       lo\n"
          "fe800000000000007ec255fffe1a2b3c 02 40 20 80     eno1\n")
    write(root, "/proc/net/route",
          "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
          "eno1\t00000000\t01010A0A\t0003\t0\t0\t100\t00000000\t0\t0\t0\n"
          "eno1\t00000A0A\t00000000\t0001\t0\t0\t100\t0000FFFF\t0\t0\t0\n"
          "docker0\t000011AC\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n")
    write(root, "/proc/net/fib_trie",
          "Main:\n  +-- 0.0.0.0/0 3 0 5\n     |-- 0.0.0.0\n        /0 universe UNICAST\n"
          "     +-- 10.10.0.0/16 2 0 2\n        |-- 10.10.0.0\n           /16 link UNICAST\n"
          "        |-- 10.10.1.17\n           /32 host LOCAL\n"
          "     +-- 127.0.0.0/8 2 0 2\n        |-- 127.0.0.1\n           /32 host LOCAL\n"
          "     |-- 172.17.0.1\n        /32 host LOCAL\n"
          "Local:\n  +-- 0.0.0.0/0 3 0 5\n     |-- 10.10.1.17\n        /32 host LOCAL\n")
    # Kernel, driver, modules.
    write(root, "/proc/sys/kernel/hostname", HOSTNAME + "\n")
    write(root, "/proc/sys/kernel/osrelease", "5.15.0-105-generic\n")
    # NCCL as a system package and as PyTorch's wheel dependency, the same release in both.
    write(root, f"/usr/lib/x86_64-linux-gnu/libnccl.so.{NCCL_VERSION}", b"")
    link(root, "/usr/lib/x86_64-linux-gnu/libnccl.so.2", f"libnccl.so.{NCCL_VERSION}")
    site = "/usr/local/lib/python3.10/dist-packages"
    write(root, f"{site}/nvidia/nccl/lib/libnccl.so.2", b"")
    write(root, f"{site}/nvidia_nccl_cu12-{NCCL_VERSION}.dist-info/METADATA", f"Name: nvidia-nccl-cu12\nVersion: {NCCL_VERSION}\n")
    # The kernel log since boot as /dev/kmsg hands it out (priority,sequence,microseconds,flags;text).
    write(root, "/.preflight/kmsg", "".join(f"{pri},{seq},{usec},-;{text}\n" for seq, (pri, usec, text) in enumerate((
        (5, 0, "Linux version 5.15.0-105-generic (buildd@lcy02-amd64-054) (gcc (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0) #115-Ubuntu SMP"),
        (6, 8123456, "nvidia: module license 'NVIDIA' taints kernel."),
        (6, 9234567, f"NVRM: loading NVIDIA UNIX x86_64 Kernel Module  {DRIVER}  Thu Feb 22 01:44:30 UTC 2024"),
        (6, 11345678, "mlx5_core 0000:1a:00.0: firmware version: 28.39.1002"),
        (6, 15456789, "mlx5_core 0000:1a:00.0 ibp26s0: renamed from ib0"),
    ))))
    fabric_manager_process(root)
    write(root, "/proc/cmdline", "BOOT_IMAGE=/vmlinuz-5.15.0-105-generic root=/dev/md0 ro quiet\n")
    write(root, "/proc/cpuinfo", "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
          "flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts acpi mmx fxsr sse sse2 ss ht tm pbe syscall nx\n\n")
    write(root, "/sys/module/nvidia/version", DRIVER + "\n")
    write(root, "/sys/module/mlx5_core/version", "24.01-0.3.3\n")
    write(root, "/sys/module/ib_core/refcnt", "6\n")
    # /sys/kernel without mm/memory_peers: no peer-memory client (GDR001's plant)
    write(root, "/sys/kernel/mm/transparent_hugepage/enabled", "always [madvise] never\n")
    write(root, "/proc/driver/nvidia/version",
          f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {DRIVER}  Tue Mar  5 22:23:56 UTC 2024\n"
          "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n")
    write(root, "/proc/meminfo", "MemTotal:       2113407588 kB\nMemFree:        2001883612 kB\nMemAvailable:   2062330164 kB\n")
    # The prolog's own process: started by slurmd, so it carries slurmd's limits.
    write(root, "/proc/self/limits", limits_table(LIMITS_ROWS))
    write(root, "/proc/self/status", "Name:\tpreflight\nUmask:\t0022\nState:\tR (running)\nUid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\nGroups:\t0 \n")
    environ = {
        "SLURM_JOB_ID": "4242", "SLURM_SCRIPT_CONTEXT": "prolog_slurmd", "SLURM_JOB_UID": "1001",
        "SLURM_JOB_GID": "1001", "SLURM_JOB_USER": "alice", "SLURM_JOB_NODELIST": "gpu[017-018]",
        "SLURMD_NODENAME": HOSTNAME, "PATH": "/usr/bin:/bin", "HOME": "/root",
    }
    write(root, "/proc/self/environ", b"".join(f"{k}={v}".encode() + b"\0" for k, v in environ.items()))
    write(root, f"/proc/{SLURMD_PID}/comm", "slurmd\n")
    write(root, f"/proc/{SLURMD_PID}/limits", limits_table(LIMITS_ROWS))
    write(root, "/run/slurmd.pid", f"{SLURMD_PID}\n")
    # Configuration files.
    write(root, "/etc/hostname", HOSTNAME + "\n")
    write(root, "/etc/hosts", f"127.0.0.1\tlocalhost\n127.0.1.1\t{HOSTNAME}.cluster\t{HOSTNAME}\n10.10.1.17\t{HOSTNAME}.cluster\t{HOSTNAME}\n\n"
          "# The following lines are desirable for IPv6 capable hosts\n::1     ip6-localhost ip6-loopback\n")
    write(root, "/etc/resolv.conf", "search cluster\nnameserver 10.10.0.2\nnameserver 10.10.0.3\n")
    write(root, "/etc/group", "root:x:0:\nvideo:x:44:\nalice:x:1001:\nrdma:x:996:alice\n")
    write(root, "/etc/security/limits.conf", "# /etc/security/limits.conf\n#<domain>      <type>  <item>         <value>\n*               soft    core           0\n")
    write(root, "/etc/security/limits.d/90-rdma.conf", "*    soft    memlock    unlimited\n*    hard    memlock    unlimited\n")
    write(root, "/etc/systemd/system.conf", "[Manager]\n#DefaultLimitNOFILE=1024:524288\n#DefaultLimitMEMLOCK=8M\n")
    write(root, "/lib/systemd/system/slurmd.service",
          "[Unit]\nDescription=Slurm node daemon\nAfter=munge.service network-online.target remote-fs.target\n\n"
          "[Service]\nType=simple\nEnvironmentFile=-/etc/default/slurmd\nExecStart=/usr/sbin/slurmd -D -s $SLURMD_OPTIONS\n"
          "ExecReload=/bin/kill -HUP $MAINPID\nKillMode=process\nLimitNOFILE=131072\nLimitSTACK=infinity\nDelegate=yes\n\n"
          "[Install]\nWantedBy=multi-user.target\n")
    write(root, "/etc/slurm/slurm.conf",
          "ClusterName=example\nSlurmctldHost=head01\nSlurmdPidFile=/run/slurmd.pid\nProctrackType=proctrack/cgroup\n"
          "TaskPlugin=task/affinity,task/cgroup\nPrologFlags=Alloc,Contain\n"
          "GresTypes=gpu\n"
          "NodeName=gpu[001-064] CPUs=224 Gres=gpu:h100:8 RealMemory=2000000 State=UNKNOWN\n"
          "PartitionName=gpu Nodes=gpu[001-064] Default=YES MaxTime=INFINITE State=UP\n")
    write(root, "/etc/nccl.conf", "NCCL_BUFFSIZE=268435456\nNCCL_GDRCOPY_ENABLE=1\nNCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7\n")
    # Recorded answers for what the kernel does not show as files.
    nvml = {
        "format": "preflight-nvml/1",
        "calls": {
            "nvmlSystemGetDriverVersion": {"result": DRIVER},
            "nvmlSystemGetCudaDriverVersion_v2": {"result": DRIVER_CUDA},
            "nvmlDeviceGetCount": {"result": len(PAIRS)},
            "nvmlDeviceGetName": nvml_devices["name"],
            "nvmlDeviceGetPciInfo": nvml_devices["pci"],
            "nvmlDeviceGetUUID": nvml_devices["uuid"],
            "nvmlDeviceGetBAR1MemoryInfo": nvml_devices["bar1"],
            "nvmlDeviceGetGpuFabricInfo": nvml_devices["fabric"],
            "nvmlDeviceGetRemappedRows": nvml_devices["rows"],
            **nvlink_and_p2p_answers(len(PAIRS)),
            "nvmlDeviceGetPersistenceMode": nvml_devices["persistence"],
            "nvmlDeviceGetEccMode": nvml_devices["ecc_mode"],
            "nvmlDeviceGetTotalEccErrors": nvml_devices["ecc_volatile"],
            "nvmlDeviceGetCurrentClocksThrottleReasons": nvml_devices["clock_reasons"],
            "nvmlDeviceGetRetiredPagesPendingStatus": nvml_devices["pages_pending"],
        },
    }
    write(root, "/.preflight/nvml.json", json.dumps(nvml, indent=1) + "\n")
    dns = {
        "format": "preflight-dns/1",
        "nameservers": ["10.10.0.2", "10.10.0.3"],
        "answers": {
            f"{HOSTNAME} A": {"addresses": ["10.10.1.17"]},
            f"{HOSTNAME} AAAA": {"error": "NOANSWER"},
        },
    }
    dns["answers"].update(NAME_SERVICE_ANSWERS)
    dns["servers"] = {"10.10.0.2": {"rcode": "NOERROR", "elapsed_s": 0.0011}, "10.10.0.3": {"rcode": "NOERROR", "elapsed_s": 0.0014}}
    write(root, "/.preflight/dns.json", json.dumps(dns, indent=1) + "\n")
    # /dev/shm: the host's tmpfs, half of RAM by default (tmpfs(5)), a few MiB in use.
    shm_blocks = 1056703794 * 1024 // 4096
    write(root, "/.preflight/statvfs.json", json.dumps({"format": "preflight-statvfs/1", "mounts": {
        "/dev/shm": {"f_frsize": 4096, "f_blocks": shm_blocks, "f_bfree": shm_blocks - 1536, "f_bavail": shm_blocks - 1536}}}, indent=1) + "\n")
    name_service_and_sockets(root)
    open_firewall(root)


# -- The host firewall (SOCK004, NCCL004, GLOO002) ------------------------------------------------
# Healthy: iptables (nft backend) with its default chains and policies ACCEPT, no rules, as
# `preflight snapshot` records it (the kernel keeps the ruleset in memory, so a root without this
# file leaves the three references unknown).
def open_firewall(root: str) -> None:
    net = os.path.join(root, "sys/class/net")
    interfaces = []
    for name in sorted(os.listdir(net)):
        with open(os.path.join(net, name, "ifindex")) as handle:
            interfaces.append([int(handle.read()), name])
    chains = [
        {"family": "ip", "table": "filter", "name": name, "hook": hook, "priority": 0, "policy": "accept", "chain_type": "filter", "rules": [], "devices": []}
        for name, hook in (("INPUT", "input"), ("FORWARD", "forward"), ("OUTPUT", "output"))
    ]
    document = {"format": "preflight-firewall/1", "ruleset": {"chains": chains, "rule_count": 0, "interfaces": sorted(interfaces)}}
    write(root, "/.preflight/firewall.json", json.dumps(document, indent=1) + "\n")


# -- Name service order, peers' DNS records and TCP sockets (DNS001, SOCK001, SOCK005) -----------
# All healthy: the peer gpu018 (the job's other node in SLURM_JOB_NODELIST, whose route the network
# checks also look up) resolves forward and back, both nameservers answer, nothing listens
# on torchrun's default port 29500 and the ephemeral range is the kernel default.
NAME_SERVICE_ANSWERS = {
    "gpu018 A": {"addresses": ["10.10.1.18"]},
    "gpu018 AAAA": {"error": "NOANSWER"},
    "10.10.1.17 PTR": {"names": [f"{HOSTNAME}.cluster."]},
    "10.10.1.18 PTR": {"names": ["gpu018.cluster."]},
}
TCP_HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode"
TCP6_HEADER = ("  sl  local_address                         remote_address                        st tx_queue "
               "rx_queue tr tm->when retrnsmt   uid  timeout inode")


def proc_net_hex(address: str) -> str:
    """An address as /proc/net/tcp{,6} prints it: 32-bit words in little-endian host order."""
    import ipaddress

    packed = ipaddress.ip_address(address).packed
    return "".join(packed[i:i + 4][::-1].hex().upper() for i in range(0, len(packed), 4))


def tcp_line(sl: int, local: tuple[str, int], remote: tuple[str, int], state: int, uid: int, inode: int) -> str:
    """One socket in the layout of get_tcp4_sock()/get_tcp6_sock() (net/ipv4/tcp_ipv4.c), or of
    get_timewait4_sock() for TIME_WAIT (timer 3, no uid or inode, refcount 3)."""
    if state == 0x06:
        return (f"{sl:4d}: {proc_net_hex(local[0])}:{local[1]:04X} {proc_net_hex(remote[0])}:{remote[1]:04X} 06 "
                "00000000:00000000 03:00000D3F 00000000     0        0 0 3 0000000000000000")
    return (f"{sl:4d}: {proc_net_hex(local[0])}:{local[1]:04X} {proc_net_hex(remote[0])}:{remote[1]:04X} {state:02X} "
            f"00000000:00000000 00:00000000 00000000 {uid:5d}        0 {inode} 1 0000000000000000 100 0 0 10 0")


def name_service_and_sockets(root: str) -> None:
    write(root, "/etc/nsswitch.conf", "passwd:         files\ngroup:          files\nhosts:          files dns\n"
          "networks:       files\n")
    write(root, "/proc/sys/net/ipv4/ip_local_port_range", "32768\t60999\n")
    write(root, "/proc/sys/net/ipv4/ip_local_reserved_ports", "\n")
    sockets = [
        (("0.0.0.0", 22), ("0.0.0.0", 0), 0x0A, 0, 21786),  # sshd
        (("0.0.0.0", 6818), ("0.0.0.0", 0), 0x0A, 0, 24410),  # slurmd
        (("127.0.0.1", 6666), ("0.0.0.0", 0), 0x0A, 0, 23311),  # nv-fabricmanager's command port
        (("10.10.1.17", 22), ("10.10.0.5", 51544), 0x01, 0, 88122),  # an admin's ssh session
        (("10.10.1.17", 41822), ("10.10.0.1", 6817), 0x06, 0, 0),  # slurmd -> slurmctld, closed
    ]
    write(root, "/proc/net/tcp", "\n".join([TCP_HEADER] + [tcp_line(n, *s) for n, s in enumerate(sockets)]) + "\n")
    write(root, "/proc/net/tcp6", TCP6_HEADER + "\n" + tcp_line(0, ("::", 22), ("::", 0), 0x0A, 0, 21788) + "\n")


# -- NVLink, P2P and the fabric manager (NVL003, NVL004, NVL006, PCI004) ------------------------
# Healthy: every H100 SXM has 18 NVLinks, all active, to the four NVSwitches; the driver reports
# P2P read, write and NVLink OK between every pair; the fabric manager started with the driver
# 42 s after boot and listens on its command port.
NVLINKS_PER_GPU = 18
NVML_NVLINK_MAX_LINKS = 36
H100_COMPUTE_CAPABILITY = [9, 0]


def nvlink_and_p2p_answers(gpus: int) -> dict[str, dict[str, object]]:
    """NVML answers as the live source records them: link numbers past the GPU's last link answer
    INVALID_ARGUMENT; P2P keys are "<gpu>/gpu<peer>/<caps index>" (read 0, write 1, NVLink 2)."""
    links: dict[str, object] = {}
    p2p: dict[str, object] = {}
    capability: dict[str, object] = {}
    for index in range(gpus):
        capability[str(index)] = {"result": H100_COMPUTE_CAPABILITY}
        for link in range(NVML_NVLINK_MAX_LINKS):
            links[f"{index}/{link}"] = {"result": 1} if link < NVLINKS_PER_GPU else {"error": "NVML_ERROR_INVALID_ARGUMENT"}
        for peer in range(gpus):
            if peer != index:
                for caps in (0, 1, 2):
                    p2p[f"{index}/gpu{peer}/{caps}"] = {"result": 0}  # NVML_P2P_STATUS_OK
    return {"nvmlDeviceGetNvLinkState": links, "nvmlDeviceGetP2PStatus": p2p, "nvmlDeviceGetCudaComputeCapability": capability}


def proc_stat(pid: int, comm: str, ppid: int, start_ticks: int) -> str:
    """``/proc/<pid>/stat`` as do_task_stat() prints it; field 22 is the start time in clock
    ticks after boot."""
    fields = ["S", ppid, pid, pid, 0, -1, 4194560, 2543, 0, 0, 0, 12, 31, 0, 0, 20, 0, 32, 0, start_ticks,
              1789771776, 3456, 18446744073709551615, 1, 1, 0, 0, 0, 0, 0, 4096, 16384, 0, 0, 0, 17, 3, 0, 0, 0, 0, 0]
    return f"{pid} ({comm}) " + " ".join(str(field) for field in fields) + "\n"


def fabric_manager_process(root: str) -> None:
    write(root, "/proc/1/comm", "systemd\n")
    write(root, "/proc/1/stat", proc_stat(1, "systemd", 0, 12))
    # The host's init: no container= in its environment (NVL006 takes the process table for the host's).
    write(root, "/proc/1/environ", b"HOME=/\0init=/sbin/init\0TERM=linux\0BOOT_IMAGE=/boot/vmlinuz-5.15.0-1042-nvidia\0")
    write(root, f"/proc/{FABRIC_MANAGER_PID}/comm", "nv-fabricmanage\n")  # the kernel keeps 15 characters
    write(root, f"/proc/{FABRIC_MANAGER_PID}/stat", proc_stat(FABRIC_MANAGER_PID, "nv-fabricmanage", 1, 4215))


if __name__ == "__main__":
    # The argument is the directory that receives the root, as for every generator, so that
    # tests/nodes/test_fixture_generators.py can run them all alike.
    build(os.path.join(sys.argv[1] if len(sys.argv) > 1 else HERE, "hgx-h100"))
