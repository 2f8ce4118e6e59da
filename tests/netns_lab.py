"""A lab of real network namespaces for the tests: a namespace with links, addresses, routes and
sysctls built through pyroute2, ``preflight`` run inside it, and helpers to read its verdicts.
Used by tests/nodes/test_net_netns.py and tests/snapshot/test_snapshot.py."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import preflight_command

NAMES = itertools.count()


ENTER = "import os, sys\nfrom pyroute2 import netns\nnetns.setns(sys.argv[1], flags=0)\nos.execvp(sys.argv[2], sys.argv[2:])\n"


RECORD = """
import json, sys
from preflight.config import HostConfig, Expectations
from preflight.probes.routing import probe_routing
from preflight.probes.nccl_socket import probe_nccl_socket
from preflight.probes.job import probe_job
from preflight.sources import Sources
from preflight.sources.netlink import dump

class Recording:
    def __init__(self, inner):
        self.inner, self.asked = inner, []
    def links(self):
        return self.inner.links()
    def addresses(self):
        return self.inner.addresses()
    def route_get(self, destination, source=""):
        self.asked.append(f"{destination} from {source}" if source else destination)
        return self.inner.route_get(destination, source)

sources = Sources.for_node("/")
recording = Recording(sources.netlink)
probe_nccl_socket(sources.fs, recording, probe_job(sources.fs))
probe_routing(sources.fs, recording, sources.dns, HostConfig(expect=Expectations(peers=tuple(sys.argv[1:]))), probe_job(sources.fs))
print(json.dumps(dump(sources.netlink, recording.asked)))
"""


def etc_nccl_conf_steers_sockets() -> bool:
    try:
        text = Path("/etc/nccl.conf").read_text()
    except OSError:
        return False
    return any(name in text for name in ("NCCL_SOCKET", "NCCL_COMM_ID", "NCCL_IB_DISABLE", "NCCL_NET="))


class Namespace:
    """A named network namespace and the pyroute2 handle that builds inside it."""

    def __init__(self, name: str, ipr: Any, home: Path) -> None:
        self.name = name
        self.ipr = ipr
        self.home = home

    def index(self, ifname: str) -> int:
        return int(self.ipr.link_lookup(ifname=ifname)[0])

    def nic(self, ifname: str, *addresses: str, up: bool = True) -> None:
        """A macvlan 'NIC' on a veth whose peer stays here, with IPv4/IPv6 ``addr/len`` addresses."""
        self.ipr.link("add", ifname=f"p-{ifname}"[:15], kind="veth", peer=f"q-{ifname}"[:15])
        self.ipr.link("add", ifname=ifname, kind="macvlan", link=self.index(f"p-{ifname}"[:15]), macvlan_mode="bridge")
        self.up(f"p-{ifname}"[:15], f"q-{ifname}"[:15])
        if up:
            self.up(ifname)
        for address in addresses:
            self.addr(ifname, address)

    def up(self, *ifnames: str) -> None:
        for ifname in ifnames:
            self.ipr.link("set", index=self.index(ifname), state="up")

    def addr(self, ifname: str, address: str) -> None:
        host, _, length = address.partition("/")
        extra = {"flags": 0x80} if ":" in host else {}  # IFA_F_NODAD: usable at once, no duplicate detection wait
        self.ipr.addr("add", index=self.index(ifname), address=host, prefixlen=int(length), **extra)

    def python(self, code: str, *args: str, env: dict[str, str] | None = None) -> str:
        result = subprocess.run(
            [sys.executable, "-c", ENTER, self.name, sys.executable, "-c", code, *args],
            capture_output=True, text=True, timeout=60, cwd=self.home, env={**os.environ, **(env or {})},
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    def sysctl(self, **values: str) -> None:
        """``net.ipv4.conf.all.rp_filter="1"`` spelled ``ipv4__conf__all__rp_filter="1"``."""
        writes = {f"/proc/sys/net/{key.replace('__', '/')}": value for key, value in values.items()}
        self.python(f"for path, value in {writes!r}.items():\n    open(path, 'w').write(value)")

    def preflight(self, env: dict[str, str] | None = None, config: str = "", root: str = "") -> dict[str, Any]:
        """``preflight node --select NET`` inside the namespace (or on ``root``); the JSON report."""
        config_file = self.home / "preflight.toml"
        config_file.write_text(config)
        command = [*preflight_command(), "node", "--select", "NET", "--format", "json", "--config", str(config_file)]
        if root:
            command += ["--root", root]
        clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.home), **(env or {})}
        result = subprocess.run(
            [sys.executable, "-c", ENTER, self.name, *command],
            capture_output=True, text=True, timeout=60, env=clean, cwd=self.home,
        )
        assert result.returncode in (0, 1, 2), result.stderr
        report: dict[str, Any] = json.loads(result.stdout)
        return report


def verdicts(report: dict[str, Any]) -> dict[tuple[str, str], str]:
    return {(f["id"], f["subject"]): f["status"] for f in report["findings"]}


def present(report: dict[str, Any]) -> set[tuple[str, str]]:
    return {key for key, status in verdicts(report).items() if status == "present"}


def finding(report: dict[str, Any], ref: str, subject: str) -> dict[str, Any]:
    matches = [f for f in report["findings"] if f["id"] == ref and f["subject"] == subject]
    assert len(matches) == 1, report["findings"]
    found: dict[str, Any] = matches[0]
    return found


def evidence_text(item: dict[str, Any]) -> str:
    return " | ".join(f"{e['source']}: {e['observed']}" for e in item["evidence"])


def two_rails_in_one_subnet(ns: Namespace) -> None:
    ns.nic("ens1f0", "10.50.0.2/24")
    ns.nic("ens2f0", "10.50.0.3/24")
    ns.sysctl(ipv4__conf__all__rp_filter="1")


@contextlib.contextmanager
def namespace(prefix: str, tmp_path: Path) -> Iterator[Namespace]:
    """A fresh network namespace of our own, with loopback up and IPv6 off for new links (so no
    automatic link-local addresses; scenarios turn it on per link); removed afterwards. Skips
    the test where namespaces cannot be made (not root, no CAP_SYS_ADMIN) or where this machine's
    /etc/nccl.conf would steer every scenario."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_SYS_ADMIN); run the suite as root")
    if etc_nccl_conf_steers_sockets():
        pytest.skip("/etc/nccl.conf on this machine sets socket variables that would steer every scenario")
    from pyroute2 import IPRoute, netns

    name = f"pftest-{prefix}-{os.getpid()}-{next(NAMES)}"
    try:
        netns.create(name)
    except OSError as error:
        pytest.skip(f"cannot create a network namespace here: {error}")
    ipr = IPRoute(netns=name)
    try:
        made = Namespace(name, ipr, tmp_path)
        made.sysctl(ipv6__conf__default__disable_ipv6="1")
        made.up("lo")
        yield made
    finally:
        ipr.close()
        netns.remove(name)
