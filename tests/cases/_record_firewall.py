"""Regenerate the firewall recordings of the SOCK004, NCCL004 and GLOO002 cases from real kernels:
each case's ``root/etc/nftables.conf`` is loaded with ``nft -f`` into a fresh network namespace,
read back through netlink by preflight's own reader, and written as the case's
``root/.preflight/firewall.json``, with the interfaces of the case's base root (the namespace
has other ones). Run as root: ``.venv/bin/python tests/cases/_record_firewall.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from msgspec import to_builtins
from msgspec.structs import replace

from preflight.sources.netlink import FIREWALL_FILE, FIREWALL_FORMAT
from preflight.sources.nftables import read_ruleset
from preflight.tomlcompat import parse_toml

CASES = Path(__file__).resolve().parent
REPO = CASES.parent.parent
IDS = ("SOCK004", "NCCL004", "GLOO002")


def base_interfaces(base: Path) -> tuple[tuple[int, str], ...]:
    net = base / "sys/class/net"
    return tuple(sorted((int((entry / "ifindex").read_text()), entry.name) for entry in net.iterdir() if (entry / "ifindex").is_file()))


def record(case: Path) -> None:
    from pyroute2 import netns

    config = case / "root/etc/nftables.conf"
    base = REPO / parse_toml(case.joinpath("case.toml").read_text())["base"]
    name = f"pfrecord-{case.parent.name}-{case.name}"
    netns.create(name)
    try:
        subprocess.run(["ip", "netns", "exec", name, "nft", "-f", str(config)], check=True)
        netns.pushns(name)
        try:
            ruleset = read_ruleset()
        finally:
            netns.popns()
    finally:
        netns.remove(name)
    ruleset = replace(ruleset, interfaces=base_interfaces(base))
    document = {"format": FIREWALL_FORMAT, "ruleset": to_builtins(ruleset)}
    target = case / "root/.preflight" / FIREWALL_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(document, indent=1) + "\n")
    print(f"{target.relative_to(REPO)}: {ruleset.rule_count} rules")


if __name__ == "__main__":
    for ref_id in sys.argv[1:] or IDS:
        for verdict in ("present", "absent"):
            record(CASES / ref_id / verdict)
