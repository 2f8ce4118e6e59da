"""``preflight snapshot --scrub``: identifiers are replaced consistently (same key, same value,
same placeholder, on every node), the relations checks rely on survive (subnets, special address
blocks, GIDs embedding addresses, hostlists), and a scrubbed snapshot of the example node gives
the same statuses for the same references."""

from __future__ import annotations

import ipaddress
import json
import random
import struct
import tarfile
from pathlib import Path
from typing import Any

import pytest

from conftest import EXAMPLE_ROOT, REPO, Runner, write
from preflight.scrub import Scrubber, ScrubError, parse_categories
from preflight.snapshot import SnapshotArgs, take_snapshot
from preflight.sources.archive import Member
from preflight.sources.routes import parse_route_table

ALL = parse_categories(["all"])


def scrubber(key: str = "site-key", categories: frozenset[str] = ALL) -> Scrubber:
    return Scrubber(categories, key)


def common_prefix(a: int, b: int, bits: int) -> int:
    return bits - (a ^ b).bit_length()


def members_of(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


# -- the example node ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scrubbed_example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    archive = tmp_path_factory.mktemp("scrub") / "gpu017.tar.gz"
    take_snapshot(SnapshotArgs(output=str(archive), root=str(EXAMPLE_ROOT), scrub=("all",), scrub_key="site-key"))
    return archive


def test_scrubbed_example_keeps_every_status(scrubbed_example: Path, run_cli: Runner) -> None:
    direct = json.loads(run_cli("node", "--root", str(EXAMPLE_ROOT), "--format", "json").stdout)
    replayed = json.loads(run_cli("node", "--root", str(scrubbed_example), "--format", "json").stdout)
    assert [(f["id"], f["status"], f["severity"]) for f in replayed["findings"]] == [(f["id"], f["status"], f["severity"]) for f in direct["findings"]]
    assert replayed["summary"] == direct["summary"]
    assert [(p["name"], p["status"]) for p in replayed["probes"]] == [(p["name"], p["status"]) for p in direct["probes"]]
    assert replayed["host"] != "gpu017" and replayed["host"].endswith("017")


def test_scrubbed_example_holds_no_original_identifiers(scrubbed_example: Path) -> None:
    original = {
        "gpu017", "gpu018", "10.10.1.17", "10.10.1.18", "10.10.0.2", "gpu017.cluster",
        "5f1c7e2a-0c3b-4d7e-9a61",  # GPU UUIDs
        "alice",  # SLURM_JOB_USER in the job environment
    }
    for path, data in members_of(scrubbed_example).items():
        text = data.decode("utf-8", "replace")
        for identifier in original:
            assert identifier not in text and identifier not in path, (identifier, path)
    manifest = json.loads(members_of(scrubbed_example)[".preflight/snapshot.json"])
    assert manifest["scrub"]["categories"] == sorted(ALL) and manifest["scrub"]["key"] == "given"
    assert manifest["scrub"]["key_id"] == scrubber().key_id() and "site-key" not in json.dumps(manifest)


def test_two_nodes_scrubbed_with_one_key_stay_comparable(tmp_path: Path) -> None:
    """The same value gets the same placeholder in two snapshots of different roots."""
    def environ(key: str, root: Path) -> str:
        archive = tmp_path / f"{root.name}-{key}.tar.gz"
        take_snapshot(SnapshotArgs(output=str(archive), root=str(root), scrub=("hostnames", "addresses"), scrub_key=key))
        return members_of(archive)["etc/hosts"].decode()

    dns_peers = REPO / "tests" / "fixtures" / "nodes" / "dns-peers"
    assert "localhost" in environ("k1", dns_peers)
    first, again, other = environ("k1", EXAMPLE_ROOT), environ("k1", EXAMPLE_ROOT), environ("k2", EXAMPLE_ROOT)
    assert first == again and first != other
    assert scrubber("k1").scrub_text("10.10.1.17 gpu017") == scrubber("k1").scrub_text("10.10.1.17 gpu017")


def test_without_a_key_snapshots_are_consistent_only_within_themselves() -> None:
    one, two = Scrubber(ALL), Scrubber(ALL)
    assert one.scrub_text("10.1.2.3") == one.scrub_text("10.1.2.3") != two.scrub_text("10.1.2.3")
    assert one.scrub_manifest({})["scrub"]["key"].startswith("random")
    with pytest.raises(ScrubError):
        parse_categories(["hostnames", "passwords"])
    with pytest.raises(ScrubError):
        Scrubber(ALL, "")


# -- addresses ------------------------------------------------------------------------------------
def test_ipv4_mapping_preserves_prefixes_and_blocks() -> None:
    scrub = scrubber()
    rng = random.Random(7)
    samples = [int(ipaddress.IPv4Address("10.0.0.0")) + rng.randrange(1 << 24) for _ in range(200)]
    for a, b in zip(samples, samples[1:]):
        assert common_prefix(scrub.map_ipv4(a), scrub.map_ipv4(b), 32) == common_prefix(a, b, 32)
    assert len({scrub.map_ipv4(value) for value in samples}) == len(set(samples))  # a permutation
    kept = ["127.0.0.1", "127.0.1.1", "0.0.0.0", "255.255.255.0", "255.255.0.0", "224.0.0.251"]
    assert [scrub.scrub_text(address) for address in kept] == kept
    for address, block in (("10.4.5.6", "10.0.0.0/8"), ("172.20.1.1", "172.16.0.0/12"), ("192.168.7.9", "192.168.0.0/16"),
                           ("169.254.3.4", "169.254.0.0/16"), ("100.70.0.1", "100.64.0.0/10")):
        mapped = scrub.scrub_text(address)
        assert mapped != address and ipaddress.IPv4Address(mapped) in ipaddress.IPv4Network(block)


def test_address_ranges_are_scrubbed_and_a_firewall_recording_keeps_what_they_match() -> None:
    """nftables writes address ranges ("10.10.1.17-10.10.1.30"). In text both ends are replaced;
    in a firewall recording each range becomes the CIDR blocks it is made of, which a
    prefix-preserving map takes onto blocks, so the scrubbed rule matches exactly the images of
    the addresses the original matched (a mapped range's ends could come out in either order)."""
    scrub = scrubber()
    text = scrub.scrub_text("ip saddr 10.10.1.17-10.10.1.30 accept")
    assert "10.10.1.17" not in text and "10.10.1.30" not in text and text.count("-") == 1
    rule = {"field": "ip saddr", "op": "==", "values": ["10.10.1.17-10.10.1.30", "10.10.0.0/16"], "mask": 0}
    recording = {"format": "preflight-firewall/1", "ruleset": {"chains": [{"rules": [{"conditions": [rule]}]}]}}
    scrubbed = json.loads(scrub.scrub_file(".preflight/firewall.json", json.dumps(recording).encode()))
    values = scrubbed["ruleset"]["chains"][0]["rules"][0]["conditions"][0]["values"]
    assert not any("10.10.1." in value for value in values) and all("-" not in value for value in values)
    blocks = [ipaddress.IPv4Network(value) for value in values[:-1]]
    inside = range(int(ipaddress.IPv4Address("10.10.1.17")), int(ipaddress.IPv4Address("10.10.1.30")) + 1)
    images = {ipaddress.IPv4Address(scrub.map_ipv4(value)) for value in inside}
    assert images == {address for block in blocks for address in block}


def test_ipv6_mapping_preserves_prefixes_and_blocks() -> None:
    scrub = scrubber()
    rng = random.Random(11)
    base = int(ipaddress.IPv6Address("2001:470:1f0b::"))
    samples = [base + rng.randrange(1 << 80) for _ in range(100)]
    for a, b in zip(samples, samples[1:]):
        assert common_prefix(scrub.map_ipv6(a), scrub.map_ipv6(b), 128) == common_prefix(a, b, 128)
    assert scrub.scrub_text("::1") == "::1" and scrub.scrub_text("ff02::1") == "ff02::1"
    link_local = ipaddress.IPv6Address(scrub.scrub_text("fe80::c42:a1ff:fe14:e35a"))
    assert link_local.is_link_local and str(link_local).startswith("fe80::") and str(link_local) != "fe80::c42:a1ff:fe14:e35a"
    assert ipaddress.IPv6Address(scrub.scrub_text("fd12:3456::1")) in ipaddress.IPv6Network("fd00::/8")
    assert scrub.scrub_text("::ffff:10.1.2.3") == f"::ffff:{scrub.scrub_text('10.1.2.3')}"


def test_networks_and_broadcasts_stay_what_they_are() -> None:
    scrub = scrubber()
    network = ipaddress.IPv4Network(scrub.scrub_text("10.1.0.0/16"))  # strict: host bits are zero
    assert ipaddress.IPv4Address(scrub.scrub_text("10.1.2.3")) in network
    assert ipaddress.IPv4Address(scrub.scrub_text("10.1.255.255/16").split("/")[0]) == network.broadcast_address
    assert ipaddress.IPv6Network(scrub.scrub_text("2001:470:1f0b:77::/64"))


def test_gids_and_ipoib_addresses_match_the_interface_addresses() -> None:
    scrub = scrubber()
    v4 = ipaddress.IPv4Address(scrub.scrub_text("10.10.1.17"))
    gid = scrub.scrub_text("0000:0000:0000:0000:0000:ffff:0a0a:0111")
    assert gid == "0000:0000:0000:0000:0000:ffff:" + "{:04x}:{:04x}".format(*struct.unpack(">HH", v4.packed))
    v6 = scrub.scrub_text("fe80::ec4:7aff:fe12:3456")
    assert ipaddress.IPv6Address(scrub.scrub_text("fe80:0000:0000:0000:0ec4:7aff:fe12:3456")) == ipaddress.IPv6Address(v6)
    ipoib = scrub.scrub_text("00:00:10:87:fe:80:00:00:00:00:00:00:0c:42:a1:03:00:14:e3:5a")
    gid_of_port = scrub.scrub_text("fe80:0000:0000:0000:0c42:a103:0014:e35a")
    assert ipoib.startswith("00:00:10:87:") and ipoib[12:].replace(":", "") == gid_of_port.replace(":", "")
    guid = scrub.scrub_text("0c42:a103:0014:e35a")
    assert guid.startswith("0c42:a1") and guid != "0c42:a103:0014:e35a" and gid_of_port.endswith(guid)


def test_proc_net_hex_forms_are_scrubbed_like_text() -> None:
    scrub = scrubber()
    route = (
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
        "eno1\t00000000\t01000A0A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n"
        "eno1\t00000A0A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n"
    )
    scrubbed = scrub.scrub_file("proc/net/route", route.encode()).decode()
    table = parse_route_table(scrubbed)
    assert str(table[0].network) == "0.0.0.0/0" and table[0].gateway == scrub.scrub_text("10.10.0.1")
    assert str(table[1].network) == scrub.scrub_text("10.10.0.0/16")
    tcp = "  sl  local_address rem_address   st\n   0: 110A0A0A:1F90 00000000:0000 0A\n"
    assert scrub.scrub_file("proc/net/tcp", tcp.encode()).decode().split()[5].split(":") == [
        "{:08X}".format(int.from_bytes(ipaddress.IPv4Address(scrub.scrub_text("10.10.10.17")).packed, "little")), "1F90"
    ]
    inet6 = "fe800000000000000ec47afffe123456 02 40 20 80     eth0\n"
    mapped = scrub.scrub_file("proc/net/if_inet6", inet6.encode()).decode().split()[0]
    assert ipaddress.IPv6Address(int(mapped, 16)) == ipaddress.IPv6Address(scrub.scrub_text("fe80::ec4:7aff:fe12:3456"))


def test_lookalikes_are_left_alone() -> None:
    scrub = scrubber()
    for text in ("MLNX_OFED 5.8-1.0.1.1", "0000:5a:01.0", "00000000:18:00.0", "10:30:00", "driver 550.54.15",
                 "0c:42:a1:03:00:14:e3:5a", "ff:ff:ff:ff:ff:ff", "01:00:5e:00:00:01"):
        assert scrub.scrub_text(text) == text


# -- MACs, serials, host names --------------------------------------------------------------------
def test_macs_keep_their_vendor_and_case() -> None:
    scrub = scrubber()
    mapped = scrub.scrub_text("b8:59:9f:3c:10:a2")
    assert mapped.startswith("b8:59:9f:") and mapped != "b8:59:9f:3c:10:a2"
    assert scrub.scrub_text("B8:59:9F:3C:10:A2") == mapped.upper()
    assert scrubber(categories=frozenset({"addresses"})).scrub_text("b8:59:9f:3c:10:a2") == "b8:59:9f:3c:10:a2"


def test_serials_and_uuids_keep_their_shape() -> None:
    scrub = scrubber()
    uuid = scrub.scrub_text("GPU-5f1c7e2a-0c3b-4d7e-9a61-000000000001")
    assert uuid.startswith("GPU-") and len(uuid) == 40 and uuid[18] == "4"
    assert uuid != "GPU-5f1c7e2a-0c3b-4d7e-9a61-000000000001" and scrub.scrub_text("GPU-5f1c7e2a-0c3b-4d7e-9a61-000000000001") == uuid
    serial = scrub.scrub_file("sys/class/dmi/id/product_serial", b"MXQ12345AB\n").decode()
    assert serial.endswith("\n") and len(serial) == 11 and serial != "MXQ12345AB\n" and serial[:3].isupper() and serial[3:8].isdigit()
    machine_id = scrub.scrub_file("etc/machine-id", b"0123456789abcdef0123456789abcdef\n").decode().strip()
    assert len(machine_id) == 32 and int(machine_id, 16) >= 0 and machine_id != "0123456789abcdef0123456789abcdef"
    assert scrub.scrub_text("Board Serial: 1652823012345") .startswith("Board Serial: ")
    assert "1652823012345" not in scrub.scrub_text("Serial Number: 1652823012345")
    assert scrub.scrub_text("serial8250: ttyS0 at I/O 0x3f8") == "serial8250: ttyS0 at I/O 0x3f8"
    nvml = json.dumps({"calls": {"nvmlDeviceGetSerial": {"0": {"result": "1652823012345"}}, "nvmlDeviceGetCount": {"result": 8}}})
    scrubbed = json.loads(scrub.scrub_file(".preflight/nvml.json", nvml.encode()))
    assert scrubbed["calls"]["nvmlDeviceGetSerial"]["0"]["result"] != "1652823012345"
    assert scrubbed["calls"]["nvmlDeviceGetCount"] == {"result": 8}


def _vpd(serial: bytes) -> bytes:
    ident = b"ConnectX-7 VPI adapter card"
    body = b"PN\x0aMCX755106A" + b"SN" + bytes([len(serial)]) + serial + b"V2\x0bSMDL=SW_MNG"
    data = bytes([0x82]) + struct.pack("<H", len(ident)) + ident
    read_only = body + b"RV\x01\x00"
    data += bytes([0x90]) + struct.pack("<H", len(read_only)) + read_only
    checksum_at = len(data) - 1
    data = data[:checksum_at] + bytes([(-sum(data[:checksum_at])) & 0xFF])
    return data + b"\x78"


def test_vpd_serial_is_replaced_and_its_checksum_stays_valid() -> None:
    original = _vpd(b"MT2231X12345")
    scrubbed = scrubber().scrub_file("sys/devices/pci0000:00/0000:00:01.0/0000:1a:00.0/vpd", original)
    assert len(scrubbed) == len(original) and b"MT2231X12345" not in scrubbed
    assert b"SMDL=SW_MNG" in scrubbed and b"ConnectX-7" in scrubbed
    checksum_at = scrubbed.index(b"RV\x01") + 3
    assert sum(scrubbed[: checksum_at + 1]) & 0xFF == 0


def test_pcie_device_serial_number_capability_is_replaced() -> None:
    config = bytearray(4096)
    config[0x100:0x104] = struct.pack("<I", (0x140 << 20) | (1 << 16) | 0x0001)  # AER, next at 0x140
    config[0x140:0x144] = struct.pack("<I", (0 << 20) | (1 << 16) | 0x0003)  # DSN, last
    config[0x144:0x14C] = bytes.fromhex("5ae31400 03a1420c".replace(" ", ""))
    scrubbed = scrubber().scrub_file("sys/devices/pci0000:15/0000:15:01.0/0000:1a:00.0/config", bytes(config))
    assert scrubbed[0x144:0x14C] != config[0x144:0x14C] and scrubbed[:0x144] == bytes(config[:0x144])


def test_host_names_are_replaced_label_by_label_keeping_numbers() -> None:
    scrub = scrubber(categories=frozenset({"hostnames"}))
    members = {
        "proc/sys/kernel/hostname": Member("proc/sys/kernel/hostname", "file", b"gpu017\n"),
        "etc/hosts": Member("etc/hosts", "file", b"127.0.0.1 localhost\n127.0.1.1 gpu017.cluster gpu017\n"),
        "proc/self/environ": Member("proc/self/environ", "file", b"SLURM_JOB_NODELIST=gpu[017-018],login1\0MASTER_ADDR=gpu017\0"),
        "sys/devices/system/node/node0/cpulist": Member("sys/devices/system/node/node0/cpulist", "file", b"0-31\n"),
        "etc/preflight/preflight.toml": Member("etc/preflight/preflight.toml", "file", b'[[hosts]]\nmatch = "gpu[001-064]"\nexpect = { gpu_count = 4 }\n'),
    }
    scrubbed = {path: member.data.decode() for path, member in scrub.scrub_members(members).items()}
    host = scrubbed["proc/sys/kernel/hostname"].strip()
    stem = host[: -len("017")]
    assert host.endswith("017") and "gpu" not in host
    assert scrubbed["etc/hosts"].startswith("127.0.0.1 localhost\n")
    assert f"{host}.h" in scrubbed["etc/hosts"] and "cluster" not in scrubbed["etc/hosts"]
    assert f"SLURM_JOB_NODELIST={stem}[017-018],h" in scrubbed["proc/self/environ"] and "login1" not in scrubbed["proc/self/environ"]
    assert f"MASTER_ADDR={host}\0" in scrubbed["proc/self/environ"]
    assert f'match = "{stem}[001-064]"' in scrubbed["etc/preflight/preflight.toml"]
    assert "sys/devices/system/node/node0/cpulist" in scrubbed  # sysfs is never treated as host names


def test_names_are_scrubbed_wherever_the_audit_found_them_left() -> None:
    """Found by an audit of scrubbed snapshots: a file with one Latin-1 byte, an address ending a
    sentence, a home directory's .nccl.conf, srun's submit host, NVML's messages naming the
    recorded root, the NVLink cluster UUID NVML gives as 16 bytes (all zero: no cluster, kept), and
    host names in the kernel log, the kernel command line and the netlink recording."""
    scrub = scrubber()
    environ = b"SLURM_JOB_USER=alice\0SLURM_SRUN_COMM_HOST=login07\0HOSTNAME=gpu017\0"
    fabric = {"result": {"clusterUuid": list(range(1, 17)), "state": 3}}
    nvml = {"calls": {"nvmlInit": {"error": "no NVML recording in /home/alice/gpu017"}, "nvmlDeviceGetGpuFabricInfo": {"0": fabric, "1": {"result": {"clusterUuid": [0] * 16}}}}}
    members = {
        "proc/self/environ": Member("proc/self/environ", "file", environ),
        "proc/sys/kernel/hostname": Member("proc/sys/kernel/hostname", "file", b"gpu017\n"),
        "etc/slurm/slurm.conf": Member("etc/slurm/slurm.conf", "file", "# \xe9t\xe9 maintained by alice\nNodeName=gpu[001-064]\n".encode("latin-1")),
        "etc/motd": Member("etc/motd", "file", b"Served from 10.10.1.17. Ask fd00:1:2::17.\n"),
        "home/alice/.nccl.conf": Member("home/alice/.nccl.conf", "file", b"# alice on gpu017\nNCCL_SOCKET_IFNAME=eno1\n"),
        ".preflight/nvml.json": Member(".preflight/nvml.json", "file", json.dumps(nvml).encode()),
        ".preflight/kmsg": Member(".preflight/kmsg", "file", b"6,812,91234,-;systemd[1]: Set hostname to <gpu017>.\n"),
        "proc/cmdline": Member("proc/cmdline", "file", b"BOOT_IMAGE=/vmlinuz root=/dev/sda1 nfsroot=login07:/export\n"),
        ".preflight/netlink.json": Member(".preflight/netlink.json", "file", b'{"links": [{"name": "eno1", "alias": "uplink of gpu017"}]}'),
    }
    scrubbed = {path: member.data for path, member in scrub.scrub_members(members).items()}
    everything = b"\n".join(scrubbed.values()) + b"\n".join(path.encode() for path in scrubbed)
    for original in (b"alice", b"gpu017", b"login07", b"10.10.1.17", b"fd00:1:2::17"):
        assert original not in everything, original
    assert scrubbed["etc/slurm/slurm.conf"].startswith(b"# \xe9t\xe9 maintained by ")  # its other bytes as they were
    calls = json.loads(scrubbed[".preflight/nvml.json"])["calls"]["nvmlDeviceGetGpuFabricInfo"]
    assert calls["0"]["result"]["clusterUuid"] != list(range(1, 17)) and len(calls["0"]["result"]["clusterUuid"]) == 16
    assert calls["1"]["result"]["clusterUuid"] == [0] * 16


def test_account_names_are_replaced_in_environments_configs_and_paths() -> None:
    scrub = scrubber(categories=frozenset({"users"}))
    environ = b"USER=alice\0HOME=/home/alice\0VIRTUAL_ENV=/home/bob/venvs/train\0SLURM_JOB_USER=alice\0LOGNAME=root\0"
    members = {
        "proc/self/environ": Member("proc/self/environ", "file", environ),
        "home/bob/venvs/train/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2": Member(
            "home/bob/venvs/train/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2", "file", b""),
        "etc/slurm/slurm.conf": Member("etc/slurm/slurm.conf", "file", b"SlurmUser=slurm\n# maintained by alice, not alice2 or malice\n"),
        "sys/class/net/alice": Member("sys/class/net/alice", "file", b"alice\n"),  # sysfs: never an account
        ".preflight/statvfs.json": Member(".preflight/statvfs.json", "file", b'{"/home/alice": {"size": 1}}'),
    }
    scrubbed = {path: member.data.decode() for path, member in scrub.scrub_members(members).items()}
    alice, bob = scrub.user_placeholder("alice"), scrub.user_placeholder("bob")
    assert scrub.user_names == {"alice", "bob"}  # root is a service account
    assert scrubbed["proc/self/environ"] == (
        f"USER={alice}\0HOME=/home/{alice}\0VIRTUAL_ENV=/home/{bob}/venvs/train\0SLURM_JOB_USER={alice}\0LOGNAME=root\0"
    )
    assert f"home/{bob}/venvs/train/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2" in scrubbed
    assert scrubbed["etc/slurm/slurm.conf"] == f"SlurmUser=slurm\n# maintained by {alice}, not alice2 or malice\n"
    assert scrubbed["sys/class/net/alice"] == "alice\n"
    assert json.loads(scrubbed[".preflight/statvfs.json"]) == {f"/home/{alice}": {"size": 1}}
    assert alice != bob and alice == scrubber(categories=frozenset({"users"})).user_placeholder("alice")  # keyed


def test_a_scrubbed_virtualenv_is_still_the_jobs_nccl(tmp_path: Path, node_copy: Path, run_cli: Runner) -> None:
    """The job's venv ships NCCL 2.26.2 under /home/alice; the system's 2.21.5 is on its
    LD_LIBRARY_PATH (NCCL016). After scrubbing, the venv has moved with its owner's name and the
    finding is the same."""
    venv = "/home/alice/venvs/train/lib/python3.11/site-packages"
    write(node_copy, f"{venv}/nvidia/nccl/lib/libnccl.so.2", b"")
    write(node_copy, f"{venv}/nvidia_nccl_cu12-2.26.2.dist-info/METADATA", "Name: nvidia-nccl-cu12\nVersion: 2.26.2\n")
    environ = (node_copy / "proc/self/environ").read_bytes()
    write(node_copy, "/proc/self/environ", environ + b"VIRTUAL_ENV=/home/alice/venvs/train\0USER=alice\0LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu\0")
    archive = tmp_path / "node.tar.gz"
    take_snapshot(SnapshotArgs(output=str(archive), root=str(node_copy), scrub=("all",), scrub_key="k"))
    assert not any("alice" in path or b"alice" in data for path, data in members_of(archive).items())
    direct = json.loads(run_cli("node", "--root", str(node_copy), "--format", "json").stdout)
    replayed = json.loads(run_cli("node", "--root", str(archive), "--format", "json").stdout)
    statuses = [(f["id"], f["status"]) for f in direct["findings"]]
    assert ("NCCL016", "present") in statuses
    assert [(f["id"], f["status"]) for f in replayed["findings"]] == statuses
    (conflict,) = [f for f in replayed["findings"] if f["id"] == "NCCL016" and f["subject"] == "job environment"]
    assert "2.26.2" in conflict["evidence"][0]["expected"]


def test_config_hosts_sections_still_match_after_scrubbing(tmp_path: Path, run_cli: Runner) -> None:
    config = tmp_path / "site.toml"
    config.write_text('[[hosts]]\nmatch = "gpu[001-020]"\nexpect = { gpu_count = 16 }\n')
    archive = tmp_path / "node.tar.gz"
    take_snapshot(SnapshotArgs(output=str(archive), root=str(EXAMPLE_ROOT), config=str(config), scrub=("all",), scrub_key="k"))
    # The snapshot keeps the config it was judged with, scrubbed like the host names; a replay
    # obeys it only when the operator passes it with --config.
    recorded = tmp_path / "recorded.toml"
    recorded.write_bytes(members_of(archive)["etc/preflight/preflight.toml"])
    report: dict[str, Any] = json.loads(run_cli("node", "--root", str(archive), "--config", str(recorded), "--format", "json").stdout)
    assert ("GPU001", "present") in {(f["id"], f["status"]) for f in report["findings"]}  # the section still applies
