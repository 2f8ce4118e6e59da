"""Layers 1-2 for the network checks: NCCL's interface grammar and search, route lookups from
files and recordings, peer collection and bounded resolution, multi-rail grouping."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from preflight.probes.routing import Sysctl, collect_peers, resolve_in_dns, same_subnet_groups
from preflight.probes.nccl_socket import IfAddr, bootstrap_choice, comm_id_host, find_interfaces, getifaddrs_order, list_selects, match_subnet, nccl_choice, parse_ifname_list
from preflight.probes.job import Setting
from preflight.config import ConfigError, parse_config
from preflight.sources import NodeFS, SourceError
from preflight.sources.dns import ReplayDns
from preflight.sources.netlink import Address, FileNetlink, Link, ReplayNetlink, dump
from preflight.sources.routes import Route, file_route_get, parse_route_table, replay_route

ROUTE_HEADER = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"


def link(name: str, index: int, state: str = "up", kind: str = "", link_type: str = "ether") -> Link:
    return Link(name, index, 1500, state, link_type, kind, "", "")


def addr(ifname: str, text: str, scope: str = "global") -> Address:
    host, _, length = text.partition("/")
    return Address(ifname, 6 if ":" in host else 4, host, int(length), scope)


LINKS = (
    link("lo", 1, "unknown", link_type="loopback"), link("eno1", 2), link("docker0", 3, kind="bridge"),
    link("ib0", 4, link_type="infiniband"), link("eth10", 5), link("virbr0", 6, kind="bridge"), link("eno2", 7, "down"),
)


def candidates(*addresses: Address) -> tuple[IfAddr, ...]:
    return getifaddrs_order(LINKS, addresses)


def names(found: tuple[IfAddr, ...]) -> list[str]:
    return [item.ifname for item in found]


# -- grammar ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "exclude", "exact", "entries"),
    [
        ("eth0", False, False, ("eth0",)),
        ("^docker,lo", True, False, ("docker", "lo")),
        ("=eth0,eth1", False, True, ("eth0", "eth1")),
        ("^=eth0", True, True, ("eth0",)),
        ("eth0:5,,ib:7,", False, False, ("eth0", "ib")),  # ":<port>" and empty entries dropped
        (",".join(f"e{n}" for n in range(20)), False, False, tuple(f"e{n}" for n in range(16))),
    ],
)
def test_parse_ifname_list(text: str, exclude: bool, exact: bool, entries: tuple[str, ...]) -> None:
    spec = parse_ifname_list(text)
    assert (spec.exclude, spec.exact, spec.entries) == (exclude, exact, entries)


def test_prefix_exact_and_exclude_matching() -> None:
    assert list_selects(parse_ifname_list("eth1"), "eth10")  # NCCL's prefix match
    assert not list_selects(parse_ifname_list("=eth1"), "eth10")
    assert list_selects(parse_ifname_list("=eth1"), "eth1")
    assert not list_selects(parse_ifname_list("^docker,lo,virbr"), "docker0")
    assert list_selects(parse_ifname_list("^docker,lo,virbr"), "veth12")  # veth is not excluded by default
    assert list_selects(parse_ifname_list(""), "anything")  # an empty list matches everything


def test_getifaddrs_order_is_ipv4_first_then_ipv6_global_before_link_local() -> None:
    order = candidates(
        addr("eth10", "fe80::5/64", "link"), addr("eth10", "2001:db8::5/64"), addr("eno1", "fe80::2/64", "link"),
        addr("eth10", "10.5.0.1/24"), addr("eno1", "10.2.0.1/24"), addr("ghost", "10.9.0.1/24"),
    )
    assert [(i.ifname, i.address) for i in order] == [
        ("eno1", "10.2.0.1"), ("eth10", "10.5.0.1"), ("eno1", "fe80::2"), ("eth10", "2001:db8::5"), ("eth10", "fe80::5"),
    ]


def test_find_interfaces_first_address_running_family_and_no_ipv6_loopback() -> None:
    order = candidates(
        addr("lo", "127.0.0.1/8", "host"), addr("lo", "::1/128", "host"), addr("eno1", "10.2.0.1/24"),
        addr("eno1", "10.2.0.2/24"), addr("eno2", "10.7.0.1/24"), addr("eth10", "fe80::5/64", "link"),
    )
    everything = parse_ifname_list("")
    assert [(i.ifname, i.address) for i in find_interfaces(order, everything, None, 16)] == [
        ("lo", "127.0.0.1"), ("eno1", "10.2.0.1"), ("eth10", "fe80::5"),
    ]  # eno2 is down; ::1 is skipped; one address per interface
    assert names(find_interfaces(order, everything, 6, 16)) == ["eth10"]
    assert names(find_interfaces(order, everything, None, 1)) == ["lo"]


def test_default_order_ib_then_everything_but_docker_lo_virbr_then_docker_then_lo() -> None:
    base = (addr("lo", "127.0.0.1/8", "host"), addr("docker0", "172.17.0.1/16"), addr("virbr0", "192.168.122.1/24"))
    with_eno = (*base, addr("eno1", "10.2.0.1/24"))
    assert nccl_choice(candidates(*with_eno, addr("ib0", "192.168.50.1/24")), None, None, "", 16).rule == "'ib' prefix"
    choice = nccl_choice(candidates(*with_eno), None, None, "", 16)  # ib0 without an address does not count
    assert (choice.rule, names(choice.interfaces)) == ("names except docker,lo,virbr", ["eno1"])
    assert names(nccl_choice(candidates(*base), None, None, "", 16).interfaces) == ["docker0"]
    assert names(nccl_choice(candidates(addr("lo", "127.0.0.1/8", "host")), None, None, "", 16).interfaces) == ["lo"]
    assert nccl_choice(candidates(), None, None, "", 16).interfaces == ()


def test_socket_ifname_one_character_is_ignored_and_comm_id_subnet_step() -> None:
    order = candidates(addr("eno1", "10.2.0.1/24"), addr("eth10", "10.5.0.1/24"))
    assert names(nccl_choice(order, Setting("e", "environment"), None, "", 16).interfaces) == ["eno1", "eth10"]
    chosen = nccl_choice(order, Setting("eth1", "/etc/nccl.conf"), None, "", 16)
    assert (chosen.source, names(chosen.interfaces)) == ("/etc/nccl.conf NCCL_SOCKET_IFNAME", ["eth10"])
    by_comm_id = nccl_choice(order, None, None, "10.5.0.77", 16)
    assert (by_comm_id.rule, names(by_comm_id.interfaces)) == ("same subnet as NCCL_COMM_ID 10.5.0.77", ["eth10"])


def test_bootstrap_with_comm_id_and_link_local_never_matching_a_subnet() -> None:
    order = candidates(addr("eno1", "10.2.0.1/24"), addr("eth10", "fe80::5/64", "link"))
    devices = nccl_choice(order, None, None, "", 16)
    assert names(bootstrap_choice(order, devices, None, "").interfaces) == ["eno1"]
    comm = Setting("10.2.0.9:5000", "environment")
    assert names(bootstrap_choice(order, devices, comm, "10.2.0.9").interfaces) == ["eno1"]
    assert bootstrap_choice(order, devices, comm, "10.3.0.9").interfaces == ()
    assert "does not resolve" in bootstrap_choice(order, devices, Setting("head:5000", "environment"), "").rule
    assert match_subnet(order, "fe80::9") is None


@pytest.mark.parametrize(("value", "host"), [("10.0.0.1:5000", "10.0.0.1"), ("head01:5000", "head01"), ("[fe80::1%eth0]:5000", "fe80::1"), ("[2001:db8::1]:9", "2001:db8::1")])
def test_comm_id_host(value: str, host: str) -> None:
    assert comm_id_host(value) == host


# -- route lookups ------------------------------------------------------------------------------
def _route_root(tmp_path: Path, table: str) -> NodeFS:
    (tmp_path / "proc" / "net").mkdir(parents=True)
    (tmp_path / "proc" / "net" / "route").write_text(ROUTE_HEADER + table)
    return NodeFS(str(tmp_path))


def test_file_route_lookup_longest_prefix_metric_reject_and_blackhole(tmp_path: Path) -> None:
    fs = _route_root(
        tmp_path,
        "eth0\t00000000\t0100000A\t0003\t0\t0\t100\t00000000\t0\t0\t0\n"  # default via 10.0.0.1 dev eth0
        "eth0\t0000000A\t00000000\t0001\t0\t0\t100\t0000FFFF\t0\t0\t0\n"  # 10.0.0.0/16 dev eth0 metric 100
        "eth1\t0000000A\t00000000\t0001\t0\t0\t50\t0000FFFF\t0\t0\t0\n"  # 10.0.0.0/16 dev eth1 metric 50
        "*\t0000500A\t00000000\t0201\t0\t0\t0\t0000FFFF\t0\t0\t0\n"  # unreachable 10.80.0.0/16
        "*\t0000510A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n",  # blackhole 10.81.0.0/16
    )
    lookup = lambda destination: file_route_get(fs, ["10.0.0.2"], destination)  # noqa: E731
    assert (lookup("10.0.3.4").ifname, lookup("10.0.3.4").gateway) == ("eth1", "")
    assert (lookup("8.8.8.8").ifname, lookup("8.8.8.8").gateway) == ("eth0", "10.0.0.1")
    assert lookup("10.80.0.1").error == "EHOSTUNREACH" and lookup("10.81.0.1").error == "EINVAL"
    assert lookup("10.0.0.2").route_type == "local" and lookup("127.0.0.5").ifname == "lo"
    assert lookup("8.8.8.8").where == "/proc/net/route (main table) 8.8.8.8"
    with pytest.raises(SourceError, match="IPv6"):
        lookup("2001:db8::1")
    with pytest.raises(SourceError, match="policy rules"):
        file_route_get(fs, [], "10.0.3.4", "10.0.0.2")


FIB_TRIE_TABLES = "Main:\n  +-- 0.0.0.0/0 3 0 5\n     |-- 10.0.0.2\n        /32 host LOCAL\nLocal:\n  +-- 0.0.0.0/0 3 0 5\n"


def test_file_route_lookup_without_route_and_with_garbage(tmp_path: Path) -> None:
    fs = _route_root(tmp_path, "eth0\t0000000A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n")
    (tmp_path / "proc" / "net" / "fib_trie").write_text(FIB_TRIE_TABLES)
    unreachable = file_route_get(fs, [], "192.0.2.1")
    assert unreachable.error == "ENETUNREACH" and unreachable.describe() == "Network is unreachable (ENETUNREACH)"
    (tmp_path / "proc" / "net" / "route").write_text(ROUTE_HEADER + "eth0 zz 00 01\n")
    with pytest.raises(SourceError, match="line 2 is not a route"):
        file_route_get(NodeFS(str(tmp_path)), [], "192.0.2.1")
    (tmp_path / "proc" / "net" / "route").write_text("\x00garbage\n")
    with pytest.raises(SourceError, match="header"):
        file_route_get(NodeFS(str(tmp_path)), [], "192.0.2.1")
    with pytest.raises(SourceError, match="absent|not captured"):
        file_route_get(NodeFS(str(tmp_path / "none")), [], "192.0.2.1")


def test_no_main_table_route_beside_other_tables_is_not_an_answer(tmp_path: Path) -> None:
    """/proc/net/route shows the main table only; policy rules, which no file shows, may send the
    destination to another table. Where fib_trie lists one (AWS multi-ENI routing, VRFs), no
    main-table route says nothing; where it is unread, neither."""
    fs = _route_root(tmp_path, "eth0\t0000000A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n")
    with pytest.raises(SourceError, match="fib_trie"):
        file_route_get(fs, [], "192.0.2.1")
    (tmp_path / "proc" / "net" / "fib_trie").write_text(FIB_TRIE_TABLES + "Id 100:\n  +-- 0.0.0.0/0 2 0 2\n")
    with pytest.raises(SourceError, match="lists table 100"):
        file_route_get(NodeFS(str(tmp_path)), [], "192.0.2.1")
    assert file_route_get(NodeFS(str(tmp_path)), [], "10.0.3.4").ifname == "eth0"  # a main-table route still answers


def test_parse_route_table_reads_gateway_flags_and_metric() -> None:
    entry = parse_route_table(ROUTE_HEADER + "eno1\t00000000\t01010A0A\t0003\t0\t0\t100\t00000000\t0\t0\t0\n")[0]
    assert (entry.ifname, str(entry.network), entry.gateway, entry.metric) == ("eno1", "0.0.0.0/0", "10.10.1.1", 100)


def test_replayed_routes_answers_errors_and_gaps() -> None:
    routes = {"10.0.0.9": {"route_type": "unicast", "ifname": "eno1", "prefsrc": "10.0.0.2", "gateway": "", "table": 254},
              "10.9.0.1": {"error": "ENETUNREACH"}, "10.0.0.9 from 10.0.0.3": {"ifname": "eno1"}, "10.8.0.1": {"error": "EBOGUS"}}
    assert replay_route(routes, "rec", "10.0.0.9").describe() == "dev eno1 src 10.0.0.2"
    assert not replay_route(routes, "rec", "10.9.0.1").reachable
    assert replay_route(routes, "rec", "10.0.0.9", "10.0.0.3").where == "ip route get 10.0.0.9 from 10.0.0.3"
    with pytest.raises(SourceError, match="no recorded route for 10.7.0.1"):
        replay_route(routes, "rec", "10.7.0.1")
    with pytest.raises(SourceError, match="unknown route error"):
        replay_route(routes, "rec", "10.8.0.1")


def test_dump_records_route_lookups_and_replays_them(tmp_path: Path, example_root: Path) -> None:
    files = FileNetlink(NodeFS(str(example_root)))
    document = dump(files, ["10.10.1.18", "192.0.2.1", "127.0.0.1"])
    assert document["routes"]["192.0.2.1"]["ifname"] == "eno1"  # the example node's default route
    (tmp_path / "netlink.json").write_text(json.dumps(document))
    replay = ReplayNetlink.from_file(str(tmp_path / "netlink.json"))
    for destination in ("10.10.1.18", "192.0.2.1", "127.0.0.1"):
        live, replayed = files.route_get(destination), replay.route_get(destination)
        assert (live.ifname, live.gateway, live.route_type, live.error) == (replayed.ifname, replayed.gateway, replayed.route_type, replayed.error)


@pytest.mark.parametrize(("dump_name", "entry"), [
    ("addresses", {"ifname": "eth0", "family": 4, "address": None, "prefixlen": 24, "scope": "global"}),
    ("addresses", {"ifname": "eth0", "family": "4", "address": "10.0.0.5", "prefixlen": 24, "scope": "global"}),
    ("links", {"name": True, "index": 2, "mtu": 1500, "operstate": "up", "link_type": "ether", "kind": "", "master": "", "mac": ""}),
])
def test_replayed_entry_of_the_wrong_type_is_a_source_error(dump_name: str, entry: dict[str, object]) -> None:
    """A recording's field of the wrong type is refused where it is read, not left to fail
    (AttributeError on None.split) in a probe that trusts the record's declared types."""
    replay = ReplayNetlink({dump_name: [entry]})
    with pytest.raises(SourceError, match="malformed (address|link) entry"):
        replay.addresses() if dump_name == "addresses" else replay.links()


def test_route_evidence_texts() -> None:
    assert Route("10.0.0.9", "", "unicast", "eno1", "", "10.0.0.1", 254).describe() == "via 10.0.0.1 dev eno1"
    assert Route("10.0.0.9", "", "local", "lo", "10.0.0.9", "", 255).describe() == "local dev lo src 10.0.0.9"
    assert Route("10.0.0.9", "", "", "", "", "", None, error="EACCES").describe() == "Permission denied (EACCES)"


# -- peers ----------------------------------------------------------------------------------------
def test_collect_peers_orders_dedupes_and_skips_this_host() -> None:
    environ = {"MASTER_ADDR": "gpu002", "SLURM_JOB_NODELIST": "gpu[001-003]"}
    peers, problems = collect_peers(environ, "10.0.0.5:4000", ("gpu003,10.9.0.1",), "gpu001.cluster")
    assert list(peers.items()) == [
        ("gpu002", ["MASTER_ADDR", "SLURM_JOB_NODELIST"]), ("10.0.0.5", ["NCCL_COMM_ID"]),
        ("gpu003", ["expect.peers", "SLURM_JOB_NODELIST"]), ("10.9.0.1", ["expect.peers"]),
    ]
    assert problems == []
    _, problems = collect_peers({"SLURM_NODELIST": "gpu[1-"}, "", (), "x")
    assert problems and problems[0][0] == "SLURM_NODELIST" and "gpu[1-" in problems[0][1]


def test_dns_resolution_is_bounded_when_a_server_hangs() -> None:
    dns = ReplayDns({"answers": {"a A": {"addresses": ["10.0.0.1"]}, "a AAAA": {"error": "NOANSWER"},
                                 "b A": {"hang": True}, "c A": {"error": "NXDOMAIN"}, "c AAAA": {"error": "NXDOMAIN"}}})
    # "b" hangs forever: that the call returns at all shows the budget holds. It runs in a
    # thread only so that a regression fails here instead of hanging the suite (a hang guard).
    answers: dict[str, tuple[tuple[str, ...], str]] = {}
    worker = threading.Thread(target=lambda: answers.update(resolve_in_dns(dns, ["a", "b", "c", "d"], 0.3)), daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "resolve_in_dns waited for the hung name"
    assert answers["a"] == (("10.0.0.1",), "")
    assert answers["b"] == ((), "DNS: no answer within 0.3 s")
    assert answers["c"] == ((), "DNS: A NXDOMAIN, AAAA NXDOMAIN")
    assert answers["d"] == ((), "no recorded answer for d A")


def test_same_subnet_groups_need_two_running_interfaces() -> None:
    links = [link("r1", 2), link("r2", 3), link("r3", 4, "down"), link("mgmt", 5), link("lo", 1, "unknown", link_type="loopback")]
    addresses = [addr("r1", "10.1.0.2/24"), addr("r2", "10.1.0.3/16"), addr("r3", "10.1.0.4/24"), addr("mgmt", "10.9.0.2/24"),
                 addr("lo", "127.0.0.1/8", "host"), addr("r1", "10.1.0.9/24")]
    groups = same_subnet_groups(links, addresses)
    assert [[(a.ifname, a.address) for a in group] for group in groups] == [[("r1", "10.1.0.2"), ("r2", "10.1.0.3"), ("r1", "10.1.0.9")]]
    assert same_subnet_groups(links, [addr("r1", "10.1.0.2/24"), addr("r1", "10.1.0.3/24")]) == []


def test_effective_sysctl_is_the_larger_of_all_and_the_interface() -> None:
    assert Sysctl(0, 1).effective == 1 and Sysctl(2, 1).effective == 2 and Sysctl(None, 1).effective is None


def test_config_peers_are_hostlists_checked_when_read() -> None:
    assert parse_config('[expect]\npeers = ["gpu[01-02]", "10.0.0.5"]\n', "site.toml", "x").expect.peers == ("gpu[01-02]", "10.0.0.5")
    with pytest.raises(ConfigError, match=r"site.toml:2: expect.peers"):
        parse_config('[expect]\npeers = ["gpu[01-"]\n', "site.toml", "x")
