"""The firewall probe on real nftables rulesets: each test makes its own network namespace, loads
a ruleset into it with ``nft -f`` (never the host's own ruleset), reads it back through netlink
from inside the namespace and runs SOCK004, NCCL004 and GLOO002 there; the pure parts (set
intervals, the evaluator's walk) are tested on hand-built rules."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from conftest import Runner, preflight_command, write
from netns_lab import ENTER, Namespace, namespace

from preflight.model import Unknown
from preflight.probes.firewall import (
    PEER_ERROR,
    FirewallFacts,
    Interface,
    Outcome,
    Packet,
    evaluate,
    gloo_interfaces,
    nccl_port_findings,
    port_fates,
    readable_ruleset,
    interface_running,
    selected_interfaces,
)
from preflight.sources.nftables import Chain, Condition, Rule, Ruleset, set_intervals
from preflight.sources import NodeFS

FIREWALL_REFS = "SOCK004,NCCL004,GLOO002"

PROBE = """
import socket  # before dropping root below: this interpreter lives under /root, unreadable to nobody
import sys
import msgspec
from preflight.probes.firewall import probe_firewall
from preflight.sources import Sources
import preflight.sources.nftables as nftables
if len(sys.argv) > 1:
    nftables.MAX_RULES = int(sys.argv[1])
if len(sys.argv) > 2:
    import os
    os.setuid(int(sys.argv[2]))
sources = Sources.for_node("/")
print(msgspec.json.encode(probe_firewall(sources.fs, sources.netlink)).decode())
"""

FIREWALLD_LIKE = """
table inet firewalld {
    chain filter_INPUT {
        type filter hook input priority filter + 10; policy accept;
        ct state { established, related } accept
        ct status dnat accept
        iifname "lo" accept
        ct state invalid drop
        jump filter_INPUT_ZONES
        reject with icmpx admin-prohibited
    }
    chain filter_INPUT_ZONES {
        iifname "ens9" goto filter_IN_trusted
        goto filter_IN_public
    }
    chain filter_IN_trusted {
        accept
    }
    chain filter_IN_public {
        jump filter_IN_public_allow
        meta l4proto { icmp, ipv6-icmp } accept
    }
    chain filter_IN_public_allow {
        tcp dport 22 ct state { new, untracked } accept
        ip6 daddr fe80::/64 udp dport 546 ct state { new, untracked } accept
    }
}
"""

# What `iptables -P INPUT DROP; iptables -A INPUT -i lo -j ACCEPT; iptables -A INPUT -p tcp --dport 22
# -j ACCEPT` leaves with the nft backend: table ip filter, base chain INPUT at priority 0.
IPTABLES_NFT_DROP = """
table ip filter {
    chain INPUT {
        type filter hook input priority filter; policy drop;
        iifname "lo" counter accept
        ct state related,established counter accept
        meta l4proto tcp tcp dport 22 counter accept
    }
}
"""

def input_drop(*rules: str) -> str:
    """An inet table whose input chain drops by default and accepts what ``rules`` say."""
    body = "".join(f"        {rule}\n" for rule in rules)
    return f"table inet filter {{\n    chain input {{\n        type filter hook input priority 0; policy drop;\n{body}    }}\n}}\n"


#: Replies, loopback and the listed ports let in; everything else dropped
HOST_BASICS = ('ct state established,related accept', 'iifname "lo" accept')
EPHEMERAL_ALLOWED = input_drop(*HOST_BASICS, "tcp dport { 22, 29500 } accept", "tcp dport 32768-60999 accept")

UNDECODED_DROP = """
table inet filter {
    chain input {
        type filter hook input priority 0; policy accept;
        limit rate over 10/second tcp dport 40000-50000 drop
    }
}
"""

RENDEZVOUS_RESET = """
table ip filter {
    chain INPUT {
        type filter hook input priority 0; policy accept;
        tcp dport 29500 reject with tcp reset
    }
}
"""


@pytest.fixture
def ns(tmp_path: Path) -> Iterator[Namespace]:
    if shutil.which("nft") is None:
        pytest.skip("nft (Debian package nftables) is not installed; .ci/run installs it")
    with namespace("fw", tmp_path) as made:
        made.nic("ens9", "10.60.0.2/24")
        made.sysctl(ipv4__ip_local_port_range="32768 60999")
        yield made


def load(ns: Namespace, ruleset: str) -> None:
    path = ns.home / "ruleset.nft"
    path.write_text(ruleset)
    result = subprocess.run(["ip", "netns", "exec", ns.name, "nft", "-f", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def probe(ns: Namespace, *args: str) -> FirewallFacts:
    return msgspec.json.decode(ns.python(PROBE, *args), type=FirewallFacts)


def run_report(ns: Namespace, env: dict[str, str] | None = None, root: str = "") -> list[dict[str, Any]]:
    """The findings of the three checks run inside the namespace."""
    command = [*preflight_command(), "node", "--select", FIREWALL_REFS, "--format", "json"]
    if root:
        command += ["--root", root]
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(ns.home), **(env or {})}
    result = subprocess.run([sys.executable, "-c", ENTER, ns.name, *command], capture_output=True, text=True, timeout=120, env=clean, cwd=ns.home)
    # 3 only when the selection decided nothing (every check unknown): still a full report
    assert result.returncode in (0, 1, 2) or "no verdict: every check is unknown" in result.stderr, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return list(report["findings"])


def run_checks(ns: Namespace, env: dict[str, str] | None = None, root: str = "") -> dict[tuple[str, str], tuple[str, str]]:
    """(id, subject) -> (status, evidence or reason) of the three checks run inside the namespace."""
    return {
        (f["id"], f["subject"]): (f["status"], f.get("reason") or " | ".join(e["observed"] for e in f["evidence"]))
        for f in run_report(ns, env, root)
    }


def statuses(found: dict[tuple[str, str], tuple[str, str]]) -> dict[tuple[str, str], str]:
    """The findings that are not absent (an absent one is reported once, for the node)."""
    return {key: value[0] for key, value in found.items() if value[0] != "absent"}


# -- live namespaces ----------------------------------------------------------------------------


def test_firewalld_default_zone_rejects_nccl_and_gloo_ports_but_a_trusted_interface_passes(ns: Namespace) -> None:
    load(ns, FIREWALLD_LIKE)
    # Without an address q-ens9 is no interface NCCL or Gloo listen on: its zone rejects, but no
    # peer's SYN arrives there (a bond port, a container veth), so nothing is judged on it.
    unaddressed = statuses(run_checks(ns, {"NCCL_SOCKET_IFNAME": "=q-ens9", "GLOO_SOCKET_IFNAME": "q-ens9"}))
    assert unaddressed == {(ref, "node"): "not_applicable" for ref in ("SOCK004", "NCCL004", "GLOO002")}
    ns.addr("q-ens9", "10.61.0.2/24")
    facts = probe(ns)
    assert facts.error == "" and facts.legacy_tables == ()
    chains = {c.name: c for c in facts.ruleset.chains} if facts.ruleset else {}
    assert chains["filter_INPUT"].hook == "input" and chains["filter_INPUT"].priority == 10
    assert chains["filter_INPUT"].rules[-1].reject_with == "admin-prohibited"
    found = run_checks(ns, {"NCCL_SOCKET_IFNAME": "=q-ens9", "GLOO_SOCKET_IFNAME": "q-ens9"})
    assert statuses(found) == {("SOCK004", "q-ens9"): "present", ("GLOO002", "q-ens9"): "present"}
    assert "32768-60999" in found[("SOCK004", "q-ens9")][1] and "No route to host" in found[("SOCK004", "q-ens9")][1]
    assert "29500" in found[("GLOO002", "q-ens9")][1]
    # the cluster interface sits in the trusted zone: nothing is rejected there
    assert statuses(run_checks(ns, {"NCCL_SOCKET_IFNAME": "=ens9", "GLOO_SOCKET_IFNAME": "ens9"})) == {}


def test_no_table_and_an_accept_all_table_let_everything_through(ns: Namespace) -> None:
    assert statuses(run_checks(ns, {"NCCL_SOCKET_IFNAME": "=ens9"})) == {}
    facts = probe(ns)
    assert facts.ruleset is not None and facts.ruleset.chains == ()
    load(ns, "table inet filter {\n chain input {\n type filter hook input priority 0; policy accept;\n }\n}\n")
    assert statuses(run_checks(ns, {"NCCL_SOCKET_IFNAME": "=ens9"})) == {}


def test_iptables_nft_drop_policy_times_nccl_out(ns: Namespace) -> None:
    load(ns, IPTABLES_NFT_DROP)
    found = run_checks(ns, {"NCCL_SOCKET_IFNAME": "=ens9", "GLOO_SOCKET_IFNAME": "ens9"})
    assert statuses(found) == {("NCCL004", "ens9"): "present", ("GLOO002", "ens9"): "present"}
    assert "policy drop" in found[("NCCL004", "ens9")][1] and "times out" in found[("NCCL004", "ens9")][1]


def test_a_rule_that_opens_the_ephemeral_range_and_the_rendezvous_port(ns: Namespace) -> None:
    load(ns, EPHEMERAL_ALLOWED)
    assert statuses(run_checks(ns, {"NCCL_SOCKET_IFNAME": "=ens9", "GLOO_SOCKET_IFNAME": "ens9"})) == {}
    # a wider ephemeral range than the rule opens: the ports above it are dropped
    ns.sysctl(ipv4__ip_local_port_range="32768 65000")
    found = run_checks(ns, {"NCCL_SOCKET_IFNAME": "=ens9"})
    assert found[("NCCL004", "ens9")][0] == "present"
    assert "61000-65000" in found[("NCCL004", "ens9")][1]


def test_an_expression_we_do_not_decode_leaves_the_drop_unknown(ns: Namespace) -> None:
    load(ns, UNDECODED_DROP)
    facts = probe(ns)
    rule = facts.ruleset.chains[0].rules[0] if facts.ruleset else None
    assert rule is not None and any(c.op == "opaque" for c in rule.conditions)
    found = statuses(run_checks(ns, {"NCCL_SOCKET_IFNAME": "=ens9", "GLOO_SOCKET_IFNAME": "ens9"}))
    # a drop can never be a refusal, so SOCK004 stays absent; the drop itself depends on the rate
    assert found == {("NCCL004", "ens9"): "unknown", ("GLOO002", "ens9"): "unknown"}


UFW_COMMANDS = (
    # ufw's before.rules, as iptables-nft writes them (nft's own fib and rt expressions in
    # iptables 1.8.9; xt matches in older builds): packets not for this host leave ufw-not-local.
    ("iptables-nft", "-N ufw-not-local"),
    ("iptables-nft", "-A INPUT -j ufw-not-local"),
    ("iptables-nft", "-A ufw-not-local -m addrtype --dst-type LOCAL -j RETURN"),
    ("iptables-nft", "-A ufw-not-local -m addrtype --dst-type MULTICAST -j RETURN"),
    ("iptables-nft", "-A ufw-not-local -m addrtype --dst-type BROADCAST -j RETURN"),
    ("iptables-nft", "-A ufw-not-local -j DROP"),
    ("ip6tables-nft", "-A INPUT -m rt --rt-type 0 -j DROP"),
)


def test_ufws_address_type_and_routing_header_rules_are_decided(ns: Namespace) -> None:
    """A peer's SYN is addressed to this host (fib daddr type local) and carries no IPv6 routing
    header, so ufw's 'not local' and 'rt type 0' drops never take it: absent, not unknown."""
    if shutil.which("iptables-nft") is None:
        pytest.skip("iptables-nft (Debian package iptables) is not installed; .ci/run installs it")
    for program, command in UFW_COMMANDS:
        subprocess.run(["ip", "netns", "exec", ns.name, program, *command.split()], check=True, capture_output=True, timeout=60)
    facts = probe(ns)
    assert facts.ruleset is not None
    assert not any(c.op == "opaque" for chain in facts.ruleset.chains for rule in chain.rules for c in rule.conditions)
    found = run_checks(ns, {"NCCL_SOCKET_IFNAME": "=ens9", "GLOO_SOCKET_IFNAME": "ens9"})
    assert statuses(found) == {}, found


def test_xt_addrtype_structs_decode_both_revisions() -> None:
    from preflight.sources.nftables import xt_addrtype_conditions

    local = 1 << 2
    assert [c.text() for c in xt_addrtype_conditions(1, struct.pack("=HHI", 0, local, 0)) or []] == ["addrtype dst & 0x4 != 0"]
    assert [c.text() for c in xt_addrtype_conditions(1, struct.pack("=HHI", 0, local, 0x2)) or []] == ["addrtype dst & 0x4 == 0"]
    assert [c.text() for c in xt_addrtype_conditions(0, struct.pack("=HHII", local, 0, 1, 0)) or []] == ["addrtype src & 0x4 == 0"]
    assert xt_addrtype_conditions(2, b"") is None and xt_addrtype_conditions(1, b"\0") is None


def test_the_rendezvous_port_alone_refused(ns: Namespace) -> None:
    load(ns, RENDEZVOUS_RESET)
    found = run_checks(ns, {"GLOO_SOCKET_IFNAME": "ens9", "MASTER_PORT": "29500"})
    assert found[("GLOO002", "ens9")][0] == "present" and "tcp reset" in found[("GLOO002", "ens9")][1]
    assert statuses(run_checks(ns, {"GLOO_SOCKET_IFNAME": "ens9", "MASTER_PORT": "29600"})) == {}


def test_a_prolog_that_cannot_see_master_port_warns_about_the_default_port_without_draining(ns: Namespace) -> None:
    """A prolog sees none of what the job exports: 29500 refused is a warning there (only a job
    that sets no MASTER_PORT uses it), and an error where the job's own environment leaves it unset."""
    load(ns, RENDEZVOUS_RESET)
    prolog = {"GLOO_SOCKET_IFNAME": "ens9", "SLURM_JOB_ID": "7", "SLURM_SCRIPT_CONTEXT": "prolog_slurmd"}
    (found,) = [f for f in run_report(ns, prolog) if f["id"] == "GLOO002" and f["status"] == "present"]
    assert found["severity"] == "warning" and "not visible to a slurmd script" in found["evidence"][0]["observed"]
    (found,) = [f for f in run_report(ns, {"GLOO_SOCKET_IFNAME": "ens9", "SLURM_JOB_ID": "7"}) if f["id"] == "GLOO002" and f["status"] == "present"]
    assert found["severity"] == "error"


IPV4_ONLY_DROP = "table ip filter {\n chain INPUT {\n type filter hook input priority 0; policy drop;\n }\n}\n"
IPV6_ONLY_DROP = "table ip6 filter {\n chain INPUT {\n type filter hook input priority 0; policy drop;\n }\n}\n"


def test_the_family_the_listener_uses_is_the_one_judged(ns: Namespace) -> None:
    """A dual-stack node whose IPv4 input is locked down while IPv6 is open: NCCL with
    NCCL_SOCKET_FAMILY=AF_INET6 listens on IPv6 and is not hurt; without it NCCL takes the IPv4
    address. Gloo without GLOO_SOCKET_IFNAME binds the host name's address, whose family is not
    known here: undecided. An interface addressed in IPv6 only is judged (it was passed over as
    unaddressed), against the ip6 rules."""
    ns.sysctl(ipv6__conf__ens9__disable_ipv6="0")
    ns.addr("ens9", "2001:db8:60::2/64")
    load(ns, IPV4_ONLY_DROP)
    found = statuses(run_checks(ns, {"NCCL_SOCKET_IFNAME": "=ens9", "NCCL_SOCKET_FAMILY": "AF_INET6"}))
    assert found == {("GLOO002", "ens9"): "unknown"}
    found = statuses(run_checks(ns, {"NCCL_SOCKET_IFNAME": "=ens9", "GLOO_SOCKET_IFNAME": "ens9"}))
    assert found == {("NCCL004", "ens9"): "present", ("GLOO002", "ens9"): "present"}
    ns.nic("ens10")
    ns.sysctl(ipv6__conf__ens10__disable_ipv6="0")
    ns.addr("ens10", "2001:db8:61::2/64")
    assert probe(ns).addressed6 == ("ens10", "ens9")
    assert statuses(run_checks(ns, {"NCCL_SOCKET_IFNAME": "=ens10", "GLOO_SOCKET_IFNAME": "ens10"})) == {}
    load(ns, "flush ruleset\n" + IPV6_ONLY_DROP)
    found = run_checks(ns, {"NCCL_SOCKET_IFNAME": "=ens10", "GLOO_SOCKET_IFNAME": "ens10"})
    assert statuses(found) == {("NCCL004", "ens10"): "present", ("GLOO002", "ens10"): "present"}
    assert "ip6 filter" in found[("NCCL004", "ens10")][1]


LOOPBACK_ONLY = input_drop(*HOST_BASICS, "tcp dport 22 accept")

CONNECT_TO_OWN_ADDRESS = """
import socket
server = socket.socket()
server.bind(("10.60.0.2", 0))
server.listen()
client = socket.create_connection(("10.60.0.2", server.getsockname()[1]), timeout=3)
print("connected")
"""


def test_a_one_node_job_is_warned_not_drained(ns: Namespace) -> None:
    """A default-deny firewall that accepts lo (ufw's before.rules) drops other hosts' SYNs, but a
    job on one node (torchrun --standalone) connects to this host's own address, which the kernel
    delivers through lo: shown here by a real connection, so the finding is a warning."""
    load(ns, LOOPBACK_ONLY)
    assert ns.python(CONNECT_TO_OWN_ADDRESS).strip() == "connected"
    sockets = {"NCCL_SOCKET_IFNAME": "=ens9", "GLOO_SOCKET_IFNAME": "ens9", "MASTER_PORT": "41233"}
    standalone = {**sockets, "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "1"}
    found = {(f["id"], f["subject"]): (f["status"], f["severity"]) for f in run_report(ns, standalone)}
    assert found[("NCCL004", "ens9")] == ("present", "warning") and found[("GLOO002", "ens9")] == ("present", "warning")
    two_nodes = {**sockets, "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "2"}
    found = {(f["id"], f["subject"]): (f["status"], f["severity"]) for f in run_report(ns, two_nodes)}
    assert found[("NCCL004", "ens9")] == ("present", "error") and found[("GLOO002", "ens9")] == ("present", "error")


def test_without_cap_net_admin_the_rules_are_unknown(ns: Namespace) -> None:
    load(ns, IPTABLES_NFT_DROP)
    facts = probe(ns, "10000", "65534")
    assert facts.ruleset is None and "CAP_NET_ADMIN" in facts.error
    with pytest.raises(Unknown, match="CAP_NET_ADMIN"):
        readable_ruleset(facts)


def test_a_ruleset_past_the_rule_cap_is_not_judged(ns: Namespace) -> None:
    load(ns, input_drop(*(f"tcp dport {1000 + n} accept" for n in range(30))))
    assert probe(ns).ruleset is not None
    facts = probe(ns, "20")
    assert facts.ruleset is None and "30 rules, more than the 20 read" in facts.error


def test_snapshot_records_the_ruleset_and_a_root_without_it_is_unknown(ns: Namespace, tmp_path: Path) -> None:
    load(ns, IPTABLES_NFT_DROP)
    env = {"NCCL_SOCKET_IFNAME": "=ens9"}
    live = run_checks(ns, env)
    archive = tmp_path / "snap.tar.gz"
    command = [*preflight_command(), "snapshot", str(archive)]
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(ns.home), **env}
    result = subprocess.run([sys.executable, "-c", ENTER, ns.name, *command], capture_output=True, text=True, timeout=300, env=clean, cwd=ns.home)
    assert result.returncode == 0, result.stderr
    unpacked = tmp_path / "root"
    unpacked.mkdir()
    shutil.unpack_archive(archive, unpacked)
    recording = json.loads((unpacked / ".preflight" / "firewall.json").read_text())
    assert recording["format"] == "preflight-firewall/1" and recording["ruleset"]["chains"][0]["policy"] == "drop"
    assert statuses(run_checks(ns, root=str(unpacked))) == statuses(live)
    # links and addresses from the root's files instead of netlink.json: the ruleset still replays
    (unpacked / ".preflight" / "netlink.json").unlink()
    assert statuses(run_checks(ns, root=str(unpacked))) == statuses(live)
    # the same root without its firewall recording: unknown, never absent
    (unpacked / ".preflight" / "firewall.json").unlink()
    replayed = run_checks(ns, root=str(unpacked))
    assert {key: value for key, value in replayed.items() if key[0] == "NCCL004"} == {
        ("NCCL004", "node"): ("unknown", "nf_tables netlink: firewall rules not recorded (this root has no .preflight/firewall.json)")
    }


# -- pure parts ---------------------------------------------------------------------------------


def _chain(name: str, *rules: Rule, hook: str = "", policy: str = "", priority: int = 0) -> Chain:
    return Chain("inet", "t", name, hook, priority if hook else None, policy, "filter" if hook else "", rules)


def _dport(low: int, high: int) -> Condition:
    return Condition("th dport", "in", (f"{low}-{high}",))


PACKET = Packet(4, 40000, "eth0", 2)


def test_interval_set_elements_become_inclusive_ranges() -> None:
    # nft sends [start, end) pairs: the end marker (flag 1) is the first port after the interval
    elements = [(b"\x03\xe8", 0), (b"\x07\xd1", 1), (b"\x13\x88", 0), (b"\x13\x89", 1)]
    assert set_intervals(elements, 0x04, 2) == ((b"\x03\xe8", b"\x07\xd0"), (b"\x13\x88", b"\x13\x88"))
    assert set_intervals([(b"\x00\x16", 0)], 0, 2) == ((b"\x00\x16", b"\x00\x16"),)
    assert set_intervals([], 0x08, 2) == "concatenated or map set"


def test_jump_returns_goto_does_not_and_policy_ends_the_base_chain() -> None:
    helper = _chain("helper", Rule(1, (_dport(1, 100),), "accept"))
    jump = _chain("input", Rule(1, (), "jump", "helper"), Rule(2, (), "reject", reject_with="tcp reset"), hook="input", policy="accept")
    ruleset = Ruleset((jump, helper), 3)
    assert {o.kind for o in evaluate(ruleset, PACKET)} == {"rejected"}
    goto = _chain("input", Rule(1, (), "goto", "helper"), Rule(2, (), "reject"), hook="input", policy="drop")
    assert evaluate(Ruleset((goto, helper), 3), PACKET) == {Outcome("dropped", "inet t input", "policy drop")}


def test_accept_ends_only_its_base_chain_in_priority_order() -> None:
    early = _chain("early", Rule(1, (), "accept"), hook="input", policy="accept", priority=-10)
    late = _chain("late", Rule(1, (_dport(40000, 40000),), "drop"), hook="input", policy="accept", priority=10)
    assert {o.kind for o in evaluate(Ruleset((late, early), 2), PACKET)} == {"dropped"}
    prerouting = _chain("pre", Rule(1, (_dport(40000, 40000),), "drop"), hook="prerouting", policy="accept", priority=50)
    assert {o.rule for o in evaluate(Ruleset((late, prerouting), 2), PACKET)} == {"th dport { 40000-40000 } drop"}


def test_an_undecidable_source_address_follows_both_ways() -> None:
    rule = Rule(1, (Condition("ip saddr", "==", ("10.0.0.0/8",)),), "accept")
    chain = _chain("input", rule, hook="input", policy="drop")
    assert {o.kind for o in evaluate(Ruleset((chain,), 1), PACKET)} == {"accepted", "dropped"}
    loopback = _chain("input", Rule(1, (Condition("ip saddr", "==", ("127.0.0.0/8",)),), "accept"), hook="input", policy="drop")
    assert {o.kind for o in evaluate(Ruleset((loopback,), 1), PACKET)} == {"dropped"}


def test_ct_state_new_and_tcp_syn_are_what_the_packet_carries() -> None:
    rules = (
        Rule(1, (Condition("ct state", "!=", ("0",), 0x6),), "accept"),  # established,related: not a new SYN
        Rule(2, (Condition("tcp flags", "==", ("2",), 0x12),), "drop"),  # syn without ack
    )
    assert {o.kind for o in evaluate(Ruleset((_chain("input", *rules, hook="input", policy="accept"),), 2), PACKET)} == {"dropped"}


def test_a_jump_loop_and_too_many_branches_end_unknown() -> None:
    loop = Ruleset((_chain("input", Rule(1, (), "jump", "a"), hook="input", policy="accept"), _chain("a", Rule(1, (), "jump", "a"))), 2)
    assert [o.kind for o in evaluate(loop, PACKET)] == ["unknown"]
    opaque = tuple(Rule(n, (Condition("", "opaque", ("fib",)),), "accept") for n in range(80))
    many = Ruleset((_chain("input", *opaque, hook="input", policy="drop"),), 80)
    assert [o.kind for o in evaluate(many, PACKET)] == ["unknown"]


def test_port_fates_cut_the_range_where_rules_change_their_answer() -> None:
    chain = _chain("input", Rule(1, (_dport(32768, 50000),), "accept"), hook="input", policy="drop")
    ruleset = Ruleset((chain,), 1)
    facts = FirewallFacts(ruleset, "", "test", (), "", (Interface("eth0", 2),))
    fates = port_fates(facts, ruleset, facts.interfaces, ((32768, 60999),))
    assert [(f.low, f.high, f.outcomes[0].kind) for f in fates] == [(32768, 50000, "accepted"), (50001, 60999, "dropped")]


def test_where_ib_carries_the_data_a_block_on_some_candidates_is_undecided() -> None:
    """NCCL's own sockets are its bootstrap ones where its IB transport carries the data: they
    listen on the one interface NCCL picks first, so a zone that rejects on eno2 beside a trusted
    eno1 is undecided; without RDMA (the socket transport uses every candidate) it is present."""
    from preflight.probes.job import JobFacts
    from preflight.probes.rdma import PortRate, Problem, RdmaDevice, RdmaFacts, RdmaPort
    from preflight.probes.sockets import SocketFacts

    reject = _chain("input", Rule(1, (Condition("iifname", "==", ("eno2",)),), "reject", reject_with="admin-prohibited"),
                    hook="input", policy="accept")
    firewall = FirewallFacts(Ruleset((reject,), 1), "", "test", (), "", (Interface("eno1", 2), Interface("eno2", 3)), ("eno1", "eno2"))
    sockets = SocketFacts((32768, 60999), (), (), {}, 0, 0, (), 0, ("/proc/net/tcp",), (), 0, ())
    port = RdmaPort("mlx5_0", 1, "/sys/class/infiniband/mlx5_0/ports/1", 4, "ACTIVE", 5, "LinkUp", PortRate(400.0, 4, "NDR"),
                    "InfiniBand", 1, 1, (), "", ())
    device = RdmaDevice("mlx5_0", "/sys/class/infiniband/mlx5_0", "CA", "28.39.1002", "MT4129", "0000:1a:00.0", "0x15b3", False,
                        False, (), "uverbs0", (port,), ())
    with_ib = RdmaFacts((device,), True, ("uverbs0",), (), None, ())
    without = RdmaFacts((), False, None, (), None, ())
    job = JobFacts({}, "", ())
    [found] = nccl_port_findings(firewall, sockets, job, with_ib, frozenset({"rejected"}))
    assert (found.subject, found.status.value) == ("eno2", "unknown") and "bootstrap interface" in found.reason
    [found] = nccl_port_findings(firewall, sockets, job, without, frozenset({"rejected"}))
    assert (found.subject, found.status.value) == ("eno2", "present")
    # Whether any RDMA device exists is unread (a capture without /sys/class/infiniband): NCCL may
    # listen on one interface only, so a block on some candidates stays undecided.
    unread = RdmaFacts((), False, None, (), None, (Problem("/sys/class/infiniband", "not captured"),))
    [found] = nccl_port_findings(firewall, sockets, job, unread, frozenset({"rejected"}))
    assert found.status.value == "unknown"
    # Turned off, the IB transport carries nothing: every candidate counts again.
    [found] = nccl_port_findings(firewall, sockets, JobFacts({"NCCL_IB_DISABLE": "1"}, "", ()), with_ib, frozenset({"rejected"}))
    assert found.status.value == "present"


def test_legacy_iptables_tables_make_the_rules_unknown() -> None:
    facts = FirewallFacts(Ruleset((), 0), "", "test", ("ip:filter",), "", ())
    with pytest.raises(Unknown, match="legacy iptables"):
        readable_ruleset(facts)


PEER_ERRORS = """
table inet t {
    chain input {
        type filter hook input priority 0; policy accept;
        tcp dport 45001 reject with icmpx admin-prohibited
        tcp dport 45002 reject with tcp reset
        tcp dport 45003 reject with icmpx port-unreachable
        tcp dport 45004 reject with icmp host-prohibited
    }
}
"""

CONNECT = """
import socket, sys
for port in sys.argv[1:]:
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect(("127.0.0.1", int(port)))
        print(port, "connected")
    except OSError as error:
        print(port, error.strerror)
"""


def test_what_the_peer_sees_for_each_reject_is_what_the_kernel_reports(ns: Namespace) -> None:
    """PEER_ERROR against real connects: the rules reject on loopback here, which the kernel
    answers the same way as on any interface."""
    load(ns, PEER_ERRORS)
    facts = probe(ns)
    assert facts.ruleset is not None
    rejected = {int(r.conditions[-1].values[0]): r.reject_with for r in facts.ruleset.chains[0].rules}
    seen = dict(line.split(" ", 1) for line in ns.python(CONNECT, *map(str, rejected)).splitlines())
    assert {int(port): error for port, error in seen.items()} == {port: PEER_ERROR[kind] for port, kind in rejected.items()}


def test_attributes_that_overrun_their_message_are_refused() -> None:
    from preflight.sources.nftables import _attrs

    assert list(_attrs(b"\x08\x00\x01\x00abcd")) == [(1, b"abcd")]
    with pytest.raises(ValueError, match="overruns"):
        list(_attrs(b"\x10\x00\x01\x00abcd"))


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (None, "firewall rules not recorded (this root has no .preflight/firewall.json)"),
        ('{"format": "preflight-firewall/1", "error": "operation not permitted (EPERM)", "source": "nf_tables netlink"}', "operation not permitted (EPERM)"),
        ('{"format": "preflight-netlink/1"}', "not a preflight-firewall/1 recording"),
        ('{"format": "preflight-firewall/1", "ruleset": {"chains": "many"}}', "malformed firewall recording"),
        ("{not json", "unreadable firewall recording"),
    ],
)
def test_a_firewall_recording_that_cannot_answer_says_why(tmp_path: Path, text: str | None, reason: str) -> None:
    from preflight.sources.fs import SourceError
    from preflight.sources.netlink import load_firewall

    path = None
    if text is not None:
        path = tmp_path / "firewall.json"
        path.write_text(text)
    with pytest.raises(SourceError) as raised:
        load_firewall(None if path is None else str(path))
    assert raised.value.reason.startswith(reason)


def test_hostile_rule_values_never_crash_the_walk() -> None:
    """A recording is untrusted: values that parse as nothing make a rule undecidable, not an error."""
    odd = (
        Condition("th dport", "in", ("x-y", "")),
        Condition("th dport", "<", ()),
        Condition("ip saddr", "==", ("not-an-address/99",)),
        Condition("iif", "==", ("eth0",)),
    )
    rules = tuple(Rule(n, (condition,), "drop") for n, condition in enumerate(odd))
    outcomes = evaluate(Ruleset((_chain("input", *rules, hook="input", policy="accept"),), len(rules)), PACKET)
    assert {o.kind for o in outcomes} <= {"dropped", "accepted"} and "dropped" in {o.kind for o in outcomes}


IPTABLES_COMMANDS = (
    "-P INPUT DROP",
    "-A INPUT -i lo -j ACCEPT",
    "-A INPUT -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
    "-A INPUT -m state --state INVALID -j DROP",
    "-A INPUT -p tcp --dport 22 -m comment --comment ssh -j ACCEPT",
    "-A INPUT -p tcp -m multiport --dports 29500,29400,30000:31000 -j ACCEPT",
    "-A INPUT -p tcp --dport 40000:50000 -j REJECT --reject-with tcp-reset",
)


def test_real_iptables_nft_rules_with_xt_matches(ns: Namespace) -> None:
    """iptables-nft itself writes the rules: conntrack, state and multiport stay xt matches in
    nf_tables, which the reader decodes; the rest of the range falls to the DROP policy."""
    if shutil.which("iptables-nft") is None:
        pytest.skip("iptables-nft (Debian package iptables) is not installed; .ci/run installs it")
    for command in IPTABLES_COMMANDS:
        subprocess.run(["ip", "netns", "exec", ns.name, "iptables-nft", *command.split()], check=True, capture_output=True, timeout=60)
    facts = probe(ns)
    assert facts.ruleset is not None
    texts = [rule.text() for rule in facts.ruleset.chains[0].rules]
    assert "ct state & 0x6 != 0 accept" in texts and "ct state & 0x1 != 0 drop" in texts
    assert "meta l4proto == 6 th dport { 29500, 29400, 30000-31000 } accept" in texts
    found = run_checks(ns, {"NCCL_SOCKET_IFNAME": "=ens9", "GLOO_SOCKET_IFNAME": "ens9"})
    assert statuses(found) == {("SOCK004", "ens9"): "present", ("NCCL004", "ens9"): "present", ("GLOO002", "ens9"): "present"}
    assert "40000-50000" in found[("SOCK004", "ens9")][1] and "Connection refused" in found[("SOCK004", "ens9")][1]
    assert "50001-60999" in found[("NCCL004", "ens9")][1] and "32768-39999" in found[("NCCL004", "ens9")][1]
    assert "rendezvous" not in found[("GLOO002", "ens9")][1]  # 29500 is open


def test_a_kubernetes_worker_hosts_rules_and_addresses_are_judged(ns: Namespace) -> None:
    """kubelet's KUBE-FIREWALL drops SYNs to 127.0.0.0/8 from elsewhere, which never match a
    peer's SYN to the node's own address; NodeLocal DNSCache's /32 on a dummy interface has no
    main-table route, which the files could not place, but the kernel's address dump does
    (without pyroute2, whose import alone costs the prolog more than its whole run)."""
    if shutil.which("iptables-nft") is None:
        pytest.skip("iptables-nft (Debian package iptables) is not installed; .ci/run installs it")
    ns.nic("nodelocaldns", "169.254.20.10/32")  # a dummy device in real life, which this kernel may not offer
    for command in (
        "-N KUBE-FIREWALL",
        "-A INPUT -j KUBE-FIREWALL",
        "-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment block_incoming_localnet_connections "
        "-m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP",
    ):
        subprocess.run(["ip", "netns", "exec", ns.name, "iptables-nft", *command.split()], check=True, capture_output=True, timeout=60)
    facts = probe(ns)
    assert facts.addressed is not None and {"ens9", "nodelocaldns"} <= set(facts.addressed) and "p-ens9" not in facts.addressed
    assert "pyroute2" not in ns.python("import sys\nfrom preflight.probes.firewall import probe_firewall\nfrom preflight.sources import Sources\n"
                                       "s = Sources.for_node('/')\nprobe_firewall(s.fs, s.netlink)\nprint(sorted(sys.modules))")
    found = run_checks(ns)
    assert statuses(found) == {}, found


def test_xt_match_structs_decode_only_what_they_can_say_alone() -> None:
    import struct as struct_codes

    from preflight.sources.nftables import xt_conntrack_condition, xt_multiport_condition

    def conntrack(flags: int, invert: int, state: int) -> bytes:
        return bytes(146) + struct_codes.pack("=HHHH", flags, invert, state, 0) + bytes(8)

    assert xt_conntrack_condition(3, conntrack(1, 0, 0x8)) == Condition("ct state", "!=", ("0",), 0x8)
    assert xt_conntrack_condition(3, conntrack(1, 1, 0x8)) == Condition("ct state", "==", ("0",), 0x8)
    assert xt_conntrack_condition(3, conntrack(1 | 1 << 2, 0, 0x8)) is None  # plus an address test
    assert xt_conntrack_condition(3, b"short") is None
    ports = struct_codes.pack("=15H", 100, 200, 300, *([0] * 12))
    flags = bytes([0, 1]) + bytes(13)  # ports[1] starts a range ending at ports[2]
    assert xt_multiport_condition(1, bytes([1, 3]) + ports + flags + b"\x01") == Condition("th dport", "not in", ("100", "200-300"))
    assert xt_multiport_condition(1, bytes([0, 3]) + ports + flags + b"\x00") is None  # source ports


def test_a_netdev_ingress_chain_sees_only_its_own_device(ns: Namespace) -> None:
    load(ns, 'table netdev edge {\n chain in {\n type filter hook ingress device "q-ens9" priority 0; policy drop;\n }\n}\n')
    ns.addr("q-ens9", "10.61.0.2/24")
    facts = probe(ns)
    assert facts.ruleset is not None and facts.ruleset.chains[0].devices == ("q-ens9",)
    found = statuses(run_checks(ns, {"NCCL_SOCKET_IFNAME": "=ens9,q-ens9", "GLOO_SOCKET_IFNAME": "ens9,q-ens9"}))
    assert found == {("NCCL004", "q-ens9"): "present", ("GLOO002", "q-ens9"): "present"}


def test_only_interfaces_a_peer_can_reach_are_judged() -> None:
    """NCCL's default search skips docker, lo and virbr (src/misc/socket.cc) and any interface
    without an address; a bond or bridge port has none. When the addresses could not be read
    (None), no interface is left out."""
    links = tuple(Interface(name, index) for index, name in enumerate(("lo", "eno1", "ens1f0", "ens1f1", "bond0", "docker0", "virbr0"), 1))
    addressed = ("bond0", "docker0", "eno1", "lo", "virbr0")
    names = lambda found: [i.name for i in found]  # noqa: E731
    assert names(selected_interfaces(links, None, addressed)) == ["eno1", "bond0"]
    assert names(selected_interfaces(links, None, None)) == ["eno1", "ens1f0", "ens1f1", "bond0"]
    assert names(selected_interfaces(links, "=virbr0", addressed)) == ["virbr0"]  # asked for by name
    assert names(gloo_interfaces(links, None, addressed)) == ["eno1", "bond0"]
    assert names(gloo_interfaces(links, "ens1f0,bond0", addressed)) == ["bond0"]
    assert names(selected_interfaces(links + (Interface("ibp26s0", 9),), None, (*addressed, "ibp26s0"))) == ["ibp26s0"]


def test_no_ipv4_listener_with_ipv6_addresses_unread_is_unknown() -> None:
    """Only loopback holds an IPv4 address and /proc/net/if_inet6 could not be read: whether an
    interface holds a global IPv6 address NCCL would listen on is not known, so the answer is
    unknown, not 'no interface'; read, and no IPv6 address either, it is not applicable."""
    from preflight.model import NotApplicable
    from preflight.probes.job import JobFacts
    from preflight.probes.rdma import RdmaFacts
    from preflight.probes.sockets import SocketFacts

    links = (Interface("lo", 1), Interface("eno1", 2))
    firewall = FirewallFacts(Ruleset((), 0), "", "test", (), "", links, ("lo",), None)
    sockets = SocketFacts((32768, 60999), (), (), {}, 0, 0, (), 0, ("/proc/net/tcp",), (), 0, ())
    no_rdma = RdmaFacts((), False, None, (), None, ())
    with pytest.raises(Unknown, match="/proc/net/if_inet6"):
        nccl_port_findings(firewall, sockets, JobFacts({}, "", ()), no_rdma, frozenset({"dropped"}))
    with pytest.raises(NotApplicable):
        nccl_port_findings(msgspec.structs.replace(firewall, addressed6=()), sockets, JobFacts({}, "", ()), no_rdma, frozenset({"dropped"}))


def test_an_interface_that_is_not_running_is_no_listener(tmp_path: Path) -> None:
    """NCCL lists only running interfaces (ncclOsFindInterfaces skips those without IFF_RUNNING),
    so a firewall zone on a down port that keeps its static address blocks no NCCL connection.
    The state comes from sysfs; a name a recording made up is never looked up."""
    for name, state in (("eno1", "up\n"), ("eno2", "down\n"), ("ib0", "unknown\n"), ("eno3", "lowerlayerdown\n")):
        write(tmp_path, f"/sys/class/net/{name}/operstate", state)
    fs = NodeFS(str(tmp_path))
    assert [interface_running(fs, name) for name in ("eno1", "eno2", "ib0", "eno3", "eno9", "../../etc", "x" * 16)] == [
        True, False, True, False, None, None, None
    ]
    links = (Interface("eno1", 2, True), Interface("eno2", 3, False), Interface("eno4", 5, None))
    assert [i.name for i in selected_interfaces(links, None, ("eno1", "eno2", "eno4"))] == ["eno1", "eno4"]
    assert [i.name for i in selected_interfaces(links, "eno", ("eno1", "eno2", "eno4"))] == ["eno1", "eno4"]


def test_gloo_without_an_interface_setting_is_judged_only_when_every_interface_blocks(ns: Namespace) -> None:
    """GLOO_SOCKET_IFNAME unset: Gloo listens on the host name's address, so a management port in
    a rejecting zone beside a trusted cluster interface is undecided, not an error; a ruleset that
    blocks on both interfaces is present on both."""
    ns.addr("q-ens9", "10.61.0.2/24")
    load(ns, FIREWALLD_LIKE)
    found = run_checks(ns, {"NCCL_SOCKET_IFNAME": "=ens9"})
    assert found[("GLOO002", "q-ens9")][0] == "unknown"
    assert "GLOO_SOCKET_IFNAME is unset" in found[("GLOO002", "q-ens9")][1] and "not on ens9" in found[("GLOO002", "q-ens9")][1]
    assert ("GLOO002", "ens9") not in statuses(found)
    load(ns, IPTABLES_NFT_DROP)
    both = statuses(run_checks(ns, {"NCCL_SOCKET_IFNAME": "=ens9"}))
    assert both[("GLOO002", "ens9")] == "present" and both[("GLOO002", "q-ens9")] == "present"


def _case_without_addresses(tmp_path: Path, example_root: Path, ref_id: str, verdict: str) -> Path:
    """The case's node with /proc/net/fib_trie left out, as a partial capture would."""
    root = tmp_path / f"{ref_id}-{verdict}"
    shutil.copytree(example_root, root, symlinks=True)
    shutil.copytree(Path(__file__).resolve().parents[1] / "cases" / ref_id / verdict / "root", root, symlinks=True, dirs_exist_ok=True)
    (root / "proc/net/fib_trie").unlink()
    return root


def test_without_the_addresses_a_block_counts_only_on_every_interface(run_cli: Runner, example_root: Path, tmp_path: Path) -> None:
    """Missing is not empty: with the IPv4 address table not captured, NCCL's candidates are every
    interface but loopback, docker and libvirt bridges (whether ib* ones have an address, and so
    come first, is unknown). A ruleset that rejects on all of them is still present; one that
    trusts eno1 and rejects on the ibp* ports is undecided instead of absent or present."""
    def sock004(root: Path) -> dict[str, tuple[str, str]]:
        result = run_cli("node", "--root", str(root), "--select", "SOCK004", "--format", "json")
        assert result.returncode in (0, 1, 2, 3), result.stderr
        return {f["subject"]: (f["status"], f["reason"]) for f in json.loads(result.stdout)["findings"]}

    everywhere = sock004(_case_without_addresses(tmp_path, example_root, "SOCK004", "present"))
    assert {status for status, _ in everywhere.values()} == {"present"} and "eno1" in everywhere and "ibp26s0" in everywhere
    trusted_eno1 = sock004(_case_without_addresses(tmp_path, example_root, "SOCK004", "absent"))
    assert "eno1" not in trusted_eno1 and trusted_eno1["ibp26s0"][0] == "unknown"
    assert "which interfaces hold an IPv4 address is unknown" in trusted_eno1["ibp26s0"][1] and "but not on eno1" in trusted_eno1["ibp26s0"][1]
