"""DNS001 against a real DNS server on loopback, through the CLI and through the probe.

The server is a few lines of dnspython over a UDP socket rather than dnsmasq: it needs nothing
beyond the package's own dependency (dnsmasq is not installable everywhere CI runs and would need
root for port 53 or a config per test), binds an ephemeral port on 127.0.0.61 so it cannot clash
with a resolver already running on the machine, and can delay the answer for one name only,
which dnsmasq cannot. The zone it serves, under the search domain ``test.cluster``:

=========  ============  ===================================================
name       A             planted
=========  ============  ===================================================
gpu01      10.0.0.1      this host; PTR back to gpu01 (healthy)
gpu02      10.0.0.2      PTR says gpu99: forward/reverse mismatch
gpu03      (none)        NXDOMAIN
gpu04      10.0.0.4      answered after 1.5 s, beyond the 0.5 s lifetime
gpu05      10.0.0.5      MASTER_ADDR; healthy
gpu06      10.0.0.6      /etc/hosts says 10.0.0.66: hosts and DNS disagree
=========  ============  ===================================================

The second nameserver, 127.0.0.62 on the same port, is dead: nothing listens there.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
from collections.abc import Iterator
from msgspec.structs import replace
from pathlib import Path

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest

from conftest import REPO, Runner, write
from preflight.probes.hostname import FILES_THEN_DNS, HostnameFacts, HostsEntry, NameLookup, NssService, job_nodes, libc_lookup, parse_nsswitch_hosts, probe_hostname, select_peers
from preflight.checks.dns import hostname_resolution_broken
from preflight.config import HostConfig
from preflight.model import Observation, Severity, Status
from preflight.sources import DnsSettings, NodeFS, Sources
from preflight.sources.dns import DnsAnswer, LiveDns, NameserverCheck, ResolvConf, parse_resolv_conf
from preflight.sources.fs import DEFAULT_MAX_BYTES

FIXTURES = REPO / "tests" / "fixtures" / "nodes"
DNS_PEERS = FIXTURES / "dns-peers"
LIVE, DEAD = "127.0.0.61", "127.0.0.62"
LIFETIME = 0.5
ZONE = {
    "gpu01.test.cluster.": ("A", "10.0.0.1"), "gpu02.test.cluster.": ("A", "10.0.0.2"),
    "gpu04.test.cluster.": ("A", "10.0.0.4"), "gpu05.test.cluster.": ("A", "10.0.0.5"),
    "gpu06.test.cluster.": ("A", "10.0.0.6"),
    "1.0.0.10.in-addr.arpa.": ("PTR", "gpu01.test.cluster."), "2.0.0.10.in-addr.arpa.": ("PTR", "gpu99.test.cluster."),
    "5.0.0.10.in-addr.arpa.": ("PTR", "gpu05.test.cluster."), "6.0.0.10.in-addr.arpa.": ("PTR", "gpu06.test.cluster."),
}


class PlantedDns:
    """An authoritative server for ``ZONE``: NXDOMAIN for other names, an empty NOERROR for other
    types of known names, and answers held back for the names in ``delays``."""

    def __init__(self, address: str, port: int = 0, delays: dict[str, float] | None = None, refuse_single_label: bool = False) -> None:
        self.refuse_single_label = refuse_single_label  # as systemd-resolved's stub does (REFUSED from systemd 257)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((address, port))
        self.address, self.port = self.sock.getsockname()
        self.delays = delays or {}
        self.queries: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                wire, peer = self.sock.recvfrom(4096)
            except OSError:
                continue
            query = dns.message.from_wire(wire)
            question = query.question[0]
            name = question.name.to_text().lower()
            self.queries.append(f"{name} {dns.rdatatype.to_text(question.rdtype)}")
            response = dns.message.make_response(query)
            response.flags |= dns.flags.AA
            if self.refuse_single_label and name.count(".") == 1:
                response.set_rcode(dns.rcode.REFUSED)
            elif name not in ZONE:
                response.set_rcode(dns.rcode.NXDOMAIN)
            elif dns.rdatatype.to_text(question.rdtype) == ZONE[name][0]:
                response.answer.append(dns.rrset.from_text(name, 60, "IN", *ZONE[name]))
            delay = self.delays.get(name, 0.0)
            threading.Timer(delay, self._send, (response.to_wire(), peer)).start()

    def _send(self, wire: bytes, peer: tuple[str, int]) -> None:
        if not self._stop.is_set():
            self.sock.sendto(wire, peer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture
def server() -> Iterator[PlantedDns]:
    planted = PlantedDns(LIVE, delays={"gpu04.test.cluster.": 1.5})
    yield planted
    planted.close()


def config(tmp_path: Path, nameservers: list[str], port: int, lifetime: float = LIFETIME) -> str:
    path = tmp_path / "preflight.toml"
    servers = ", ".join(f'"{server}"' for server in nameservers)
    path.write_text(f"[run]\nprobe_timeout = 5.0\n\n[dns]\nnameservers = [{servers}]\nport = {port}\nlifetime = {lifetime}\n")
    return str(path)


def dns001(run_cli: Runner, root: Path, *extra: str) -> dict[str, dict[str, object]]:
    result = run_cli("node", "--root", str(root), "--format", "json", "--select", "DNS001", *extra)
    assert "Traceback" not in result.stderr, result.stderr
    return {f["subject"]: f for f in json.loads(result.stdout)["findings"]}


# -- end to end ---------------------------------------------------------------------------------
def test_planted_zone_through_the_cli(run_cli: Runner, server: PlantedDns, tmp_path: Path) -> None:
    # The slow name costs one lifetime, not a hang: gpu04 comes back TIMEOUT after 0.5 s below
    # (run_cli's subprocess timeout is only a hang guard; bench/deadlines.py times this run).
    found = dns001(run_cli, DNS_PEERS, "--config", config(tmp_path, [LIVE, DEAD], server.port))
    verdicts = {subject: (f["status"], f["severity"]) for subject, f in found.items()}
    assert verdicts == {
        "gpu02": ("present", "warning"),
        "gpu03": ("present", "warning"),  # a peer with no record: missing for every node alike, no drain
        "gpu04": ("unknown", "error"),
        "gpu06": ("present", "warning"),
        f"nameserver {DEAD}": ("present", "warning"),
    }
    assert found["gpu02"]["evidence"][0] == {
        "source": "DNS PTR 10.0.0.2", "observed": "gpu99.test.cluster.", "expected": "gpu02 (forward and reverse agree)",
    }
    assert [e["observed"] for e in found["gpu03"]["evidence"]] == ["no entry", "A NXDOMAIN, AAAA NXDOMAIN"]
    assert "this node is not drained for it" in found["gpu03"]["fix"]
    assert "TIMEOUT" in str(found["gpu04"]["reason"]) and "0.5 s" in str(found["gpu04"]["reason"])
    assert found["gpu06"]["evidence"][0]["observed"] == "/etc/hosts: 10.0.0.66; DNS: 10.0.0.6"
    dead = found[f"nameserver {DEAD}"]["evidence"][0]
    assert "ECONNREFUSED" in dead["observed"] and "[dns] nameservers" in dead["source"]
    # Names went only to the server that answered the health query.
    assert "gpu02.test.cluster. A" in server.queries and "2.0.0.10.in-addr.arpa. PTR" in server.queries


def test_unreachable_stub_resolver_live(run_cli: Runner, server: PlantedDns, tmp_path: Path) -> None:
    """resolv.conf names 127.0.0.53 and nothing answers there, as inside a container's netns."""
    found = dns001(run_cli, DNS_PEERS, "--config", config(tmp_path, ["127.0.0.53"], server.port))
    stub = found["nameserver 127.0.0.53"]
    assert (stub["status"], stub["severity"]) == ("present", "error")  # nobody answers at all
    assert "systemd-resolved stub" in stub["evidence"][0]["observed"]
    assert "/run/systemd/resolve/resolv.conf" in stub["fix"]
    assert "gpu01" not in found  # this host is in /etc/hosts: libc never needs DNS for it
    assert found["gpu03"]["status"] == "unknown" and "no nameserver answered" in found["gpu03"]["reason"]
    assert server.queries == []


@pytest.mark.parametrize("no_dns_needed", ["hosts-file", "nsswitch"])
def test_a_dead_nameserver_the_jobs_names_never_reach_is_a_warning(run_cli: Runner, server: PlantedDns, tmp_path: Path, no_dns_needed: str) -> None:
    """Clusters that keep every node in a managed /etc/hosts, or whose nsswitch.conf asks no DNS,
    run their jobs with every nameserver dead: libc answers the job's names first. The dead
    server is reported, and does not drain the node."""
    root = tmp_path / "node"
    shutil.copytree(DNS_PEERS, root)
    if no_dns_needed == "hosts-file":
        write(root, "/etc/hosts", "127.0.0.1 localhost\n" + "".join(f"10.0.0.{n} gpu0{n}.test.cluster gpu0{n}\n" for n in range(1, 7)))
    else:
        write(root, "/etc/nsswitch.conf", "passwd: files\nhosts: files\n")
    found = dns001(run_cli, root, "--config", config(tmp_path, ["127.0.0.53"], server.port))
    stub = found["nameserver 127.0.0.53"]
    assert (stub["status"], stub["severity"]) == ("present", "warning"), stub
    assert "the job's names do not need DNS here" in stub["evidence"][0]["observed"]
    assert all(f["severity"] != "error" or f["status"] != "present" for f in found.values()), found
    assert server.queries == []


def test_unreachable_stub_resolver_replayed(run_cli: Runner) -> None:
    found = dns001(run_cli, FIXTURES / "dns-stub-container")
    assert set(found) == {"nameserver 127.0.0.53"}
    # MASTER_ADDR is this pod, which the runtime wrote into /etc/hosts like every pod's own name:
    # no evidence that the other workers' names are there too, so the dead stub stays an error.
    assert (found["nameserver 127.0.0.53"]["status"], found["nameserver 127.0.0.53"]["severity"]) == ("present", "error")
    assert "systemd-resolved" in found["nameserver 127.0.0.53"]["fix"]


def test_loopback_host_line_found_with_live_dns(run_cli: Runner, server: PlantedDns, tmp_path: Path) -> None:
    root = tmp_path / "node"
    shutil.copytree(DNS_PEERS, root)
    write(root, "/etc/hosts", "127.0.0.1 localhost\n10.0.0.1 gpu01.test.cluster gpu01\n127.0.1.1 gpu01.test.cluster gpu01\n")
    found = dns001(run_cli, root, "--config", config(tmp_path, [LIVE], server.port))
    assert found["gpu01"]["status"] == "present" and found["gpu01"]["severity"] == "error"
    assert found["gpu01"]["evidence"][0]["source"] == "/etc/hosts:3"
    assert "cloud-init" not in found["gpu01"]["fix"]
    # Written by cloud-init's template at every boot: the fix says where to change it for good.
    header = "# Your system has configured 'manage_etc_hosts' as True.\n# As a result, if you wish for changes to this file to persist\n"
    write(root, "/etc/hosts", header + "127.0.1.1 gpu01.test.cluster gpu01\n127.0.0.1 localhost\n")
    found = dns001(run_cli, root, "--config", config(tmp_path, [LIVE], server.port))
    assert found["gpu01"]["severity"] == "error" and "/etc/cloud/templates/hosts.debian.tmpl" in found["gpu01"]["fix"]


GLIBC_READS = {
    # glibc reads bytes: a Latin-1 comment or a NUL changes nothing for the lines it parses.
    "latin-1 comment": (b"# Cluster hosts \xe9dit\xe9 par Jos\xe9\n127.0.0.1 localhost\n10.0.0.7 gpu07.test.cluster gpu07\n", None),
    "NUL in a line": (b"127.0.0.1 localhost\n10.0.0.7 gpu07.test.cluster gpu07\0 trailing bytes\n", None),
    # hosts: files myhostname, after a Latin-1 comment: myhostname answers this host's name.
    "latin-1 nsswitch.conf": (None, b"# \xe9dit\xe9\nhosts: files myhostname\n"),
}


@pytest.mark.parametrize("case", sorted(GLIBC_READS))
def test_files_that_are_not_utf8_are_read_as_glibc_reads_them(run_cli: Runner, server: PlantedDns, tmp_path: Path, case: str) -> None:
    """gpu07 has no DNS record: only /etc/hosts (or nss-myhostname) answers it. A file preflight
    could not decode used to count as glibc's UNAVAIL, the lookup went on to DNS, and the NXDOMAIN
    there drained a healthy node."""
    root = tmp_path / "node"
    shutil.copytree(DNS_PEERS, root)
    write(root, "/proc/sys/kernel/hostname", "gpu07\n")
    hosts, nsswitch = GLIBC_READS[case]
    if hosts is not None:
        write(root, "/etc/hosts", hosts)
    if nsswitch is not None:
        write(root, "/etc/nsswitch.conf", nsswitch)
    found = dns001(run_cli, root, "--config", config(tmp_path, [LIVE], server.port))
    assert "gpu07" not in found, found["gpu07"]


def test_a_hosts_file_preflight_cannot_read_whole_is_unknown(run_cli: Runner, server: PlantedDns, tmp_path: Path) -> None:
    """glibc reads /etc/hosts at any size; past preflight's read cap what it finds is unknown, not
    UNAVAIL (which sent the name on to DNS and its NXDOMAIN made an error)."""
    root = tmp_path / "node"
    shutil.copytree(DNS_PEERS, root)
    write(root, "/proc/sys/kernel/hostname", "gpu07\n")
    write(root, "/etc/hosts", b"# padding\n" * (DEFAULT_MAX_BYTES // 10 + 1) + b"10.0.0.7 gpu07\n")
    found = dns001(run_cli, root, "--config", config(tmp_path, [LIVE], server.port))
    assert found["gpu07"]["status"] == "unknown" and "larger than" in str(found["gpu07"]["reason"]), found["gpu07"]


def test_a_missing_hosts_file_is_unavail_as_glibc_says(run_cli: Runner, server: PlantedDns, tmp_path: Path) -> None:
    """glibc's files service answers UNAVAIL when /etc/hosts cannot be opened (files-XXX.c
    internal_setent), so "[NOTFOUND=return]" after it does not stop the lookup before DNS."""
    root = tmp_path / "node"
    shutil.copytree(DNS_PEERS, root)
    (root / "etc" / "hosts").unlink()
    write(root, "/etc/nsswitch.conf", "hosts: files [NOTFOUND=return] dns\n")
    found = dns001(run_cli, root, "--config", config(tmp_path, [LIVE], server.port))
    assert "gpu01" not in found, found["gpu01"]  # DNS answers 10.0.0.1
    write(root, "/etc/nsswitch.conf", "hosts: files\n")
    found = dns001(run_cli, root, "--config", config(tmp_path, [LIVE], server.port))
    # With nothing after it, the name does not resolve: this host's own name is an error.
    assert (found["gpu01"]["status"], found["gpu01"]["severity"]) == ("present", "error")
    assert found["gpu01"]["evidence"][0] == {"source": "/etc/hosts", "observed": "missing", "expected": ""}


def test_recorded_root_without_dns_is_unknown_per_name(run_cli: Runner, tmp_path: Path) -> None:
    """No dns.json and no [dns] nameservers: names that need DNS are unknown, never absent."""
    found = dns001(run_cli, DNS_PEERS)
    assert "gpu01" not in found  # /etc/hosts answers for it
    assert found["gpu02"]["status"] == "unknown" and "no DNS recording" in str(found["gpu02"]["reason"])


@pytest.mark.parametrize("nodelist", ["gpu[01-", "gpu[05-01]"])
def test_bad_node_list_is_unknown_for_the_peers(run_cli: Runner, tmp_path: Path, nodelist: str) -> None:
    root = tmp_path / "node"
    shutil.copytree(DNS_PEERS, root)
    write(root, "/proc/self/environ", f"SLURM_JOB_NODELIST={nodelist}\0".encode())
    found = dns001(run_cli, root)
    assert found["job peers"]["status"] == "unknown" and "SLURM_JOB_NODELIST" in str(found["job peers"]["reason"])


# -- the probe on the live server -----------------------------------------------------------------
def live(server: PlantedDns, *nameservers: str, lifetime: float = LIFETIME) -> LiveDns:
    return LiveDns(ResolvConf(tuple(nameservers), ("test.cluster",)), server.port, lifetime)


def test_probe_facts_from_the_live_server(server: PlantedDns) -> None:
    facts = probe_hostname(NodeFS(str(DNS_PEERS)), live(server, LIVE, DEAD), HostConfig())
    first, second = facts.nameservers
    assert (first.server, first.rcode, first.error) == (LIVE, "NOERROR", "")  # "gpu01.test.cluster." is in the zone
    assert first.elapsed_s is not None  # measured; an answer within the lifetime is the NXDOMAIN above
    assert (second.server, second.error) == (DEAD, "UNREACHABLE") and "ECONNREFUSED" in second.detail
    assert [(p.name, p.roles) for p in facts.peers] == [
        ("gpu05", ("MASTER_ADDR", "peer")), ("gpu02", ("peer",)), ("gpu03", ("peer",)), ("gpu04", ("peer",)), ("gpu06", ("peer",)),
    ]
    assert facts.dns_answers == (DnsAnswer("gpu01", "A", ("10.0.0.1",)), DnsAnswer("gpu01", "AAAA", error="NOANSWER"))
    assert facts.reverse == (DnsAnswer("10.0.0.1", "PTR", names=("gpu01.test.cluster.",)),)
    peers = {p.name: p for p in facts.peers}
    assert [a.error for a in peers["gpu03"].dns_answers] == ["NXDOMAIN", "NXDOMAIN"]
    assert [a.error for a in peers["gpu04"].dns_answers] == ["TIMEOUT", "TIMEOUT"]
    assert peers["gpu06"].hosts_entries[0].address == "10.0.0.66"
    assert {a.name: a.error or a.names for a in peers["gpu06"].reverse} == {"10.0.0.66": "NXDOMAIN", "10.0.0.6": ("gpu06.test.cluster.",)}
    assert "gpu04.test.cluster. A" in server.queries


def test_slow_nameserver_is_a_warning() -> None:
    slow = PlantedDns("127.0.0.63", delays={"gpu01.test.cluster.": 1.2})  # the health query is the slow one
    try:
        facts = probe_hostname(NodeFS(str(DNS_PEERS)), live(slow, "127.0.0.63", lifetime=2.0), HostConfig())
    finally:
        slow.close()
    (check,) = facts.nameservers
    # Answered (NOERROR, not TIMEOUT) within the 2 s lifetime, after the server's 1.2 s delay:
    # a lower bound that no load on the machine can break.
    assert check.rcode == "NOERROR" and check.elapsed_s is not None and check.elapsed_s >= 1.2
    found = {o.subject: o for o in hostname_resolution_broken(facts)}
    assert found["nameserver 127.0.0.63"].severity is Severity.WARNING
    assert f"answered in {check.elapsed_s:.2f} s" in found["nameserver 127.0.0.63"].evidence[0].observed


def test_the_health_query_is_the_name_glibc_sends_first() -> None:
    """A short host name goes out qualified by the search list: systemd-resolved's stub refuses a
    bare one-label name by design, which is no fault of a server that answers every real lookup."""
    stub = PlantedDns("127.0.0.64", refuse_single_label=True)
    try:
        facts = probe_hostname(NodeFS(str(DNS_PEERS)), live(stub, "127.0.0.64"), HostConfig())
    finally:
        stub.close()
    (check,) = facts.nameservers
    assert check.rcode in ("NOERROR", "NXDOMAIN") and stub.queries[0].startswith("gpu01.test.cluster. ")
    assert "nameserver 127.0.0.64" not in {o.subject for o in hostname_resolution_broken(facts)}


def test_site_nameservers_keep_the_search_list_and_options(tmp_path: Path) -> None:
    from preflight.sources import Sources

    root = tmp_path / "node"
    write(root, "/etc/resolv.conf", "search a.example b.example\noptions ndots:2 timeout:1 attempts:3\nnameserver 10.9.9.9\n")
    sources = Sources.for_node(str(root), DnsSettings(nameservers=("127.0.0.61",), port=5353))
    assert isinstance(sources.dns, LiveDns) and sources.dns.nameservers() == ["127.0.0.61"]
    assert sources.dns._resolv == ResolvConf(("127.0.0.61",), ("a.example", "b.example"), ndots=2)


# -- libc emulation and judgement on hand-built facts --------------------------------------------------
def test_parse_nsswitch_hosts() -> None:
    assert parse_nsswitch_hosts("") == FILES_THEN_DNS
    assert parse_nsswitch_hosts("passwd: files\n# hosts: dns\n") == FILES_THEN_DNS
    ubuntu = parse_nsswitch_hosts("hosts:          files mdns4_minimal [NOTFOUND=return] dns myhostname\n")
    assert ubuntu == (NssService("files"), NssService("mdns4_minimal", ("NOTFOUND=return",)), NssService("dns"), NssService("myhostname"))
    fedora = parse_nsswitch_hosts("hosts: files myhostname resolve [!UNAVAIL=return] dns # comment\n")
    assert fedora[2] == NssService("resolve", ("!UNAVAIL=return",))
    assert parse_nsswitch_hosts("hosts: files [ notfound=Return  unavail=continue ] dns")[0].actions == ("NOTFOUND=return", "UNAVAIL=continue")


def lookup(name: str, hosts: tuple[str, ...] = (), dns: tuple[str, ...] | str = (), roles: tuple[str, ...] = ("peer",)) -> NameLookup:
    entries = tuple(HostsEntry(address, (name,), f"/etc/hosts:{n}") for n, address in enumerate(hosts, 1))
    if isinstance(dns, str):
        answers = (DnsAnswer(name, "A", error=dns), DnsAnswer(name, "AAAA", error=dns))
    else:
        answers = (DnsAnswer(name, "A", dns), DnsAnswer(name, "AAAA", error="NOANSWER"))
    return NameLookup(name, roles, entries, answers)


def facts_with(*peers: NameLookup, order: str = "", nodes: int = 2) -> HostnameFacts:
    return HostnameFacts("gpu01", (HostsEntry("10.0.0.1", ("gpu01",), "/etc/hosts:2"),), (), (), peers=peers,
                         nodes_in_job=nodes, hosts_order=parse_nsswitch_hosts(order))


def test_libc_emulation_follows_the_hosts_line() -> None:
    only_dns = lookup("gpu02", dns=("10.0.0.2",))
    ubuntu = facts_with(order="hosts: files mdns4_minimal [NOTFOUND=return] dns myhostname")
    assert libc_lookup(only_dns, ubuntu).status == "found"  # mdns4_minimal says UNAVAIL for gpu02
    cut = facts_with(order="hosts: files [NOTFOUND=return] dns")
    assert libc_lookup(only_dns, cut).status == "not_found"
    (finding,) = hostname_resolution_broken(facts_with(only_dns, order="hosts: files [NOTFOUND=return] dns"))
    assert finding.evidence[-1].source == "/etc/nsswitch.conf"
    both = lookup("gpu02", hosts=("10.0.0.2", "127.0.1.1"), dns=("10.0.0.2",))
    assert libc_lookup(both, facts_with()).addresses == ("127.0.1.1", "10.0.0.2")
    assert libc_lookup(lookup("gpu02", dns="TIMEOUT"), facts_with()).status == "unavailable"
    assert libc_lookup(lookup("gpu02", dns="NXDOMAIN"), facts_with(order="hosts: sss files dns")).status == "undetermined"


def test_peer_and_master_addr_judgements() -> None:
    localhost = NameLookup("localhost", ("MASTER_ADDR",), (HostsEntry("127.0.0.1", ("localhost",), "/etc/hosts:1"),), ())
    (multi,) = hostname_resolution_broken(facts_with(localhost, nodes=2))
    # A loopback MASTER_ADDR is the job's own setting, the same on every node: a warning, no drain.
    assert multi.subject == "localhost" and multi.evidence[0].source == "/etc/hosts:1" and multi.severity is Severity.WARNING
    assert "not drained" in multi.fix
    assert list(hostname_resolution_broken(facts_with(localhost, nodes=1))) == []
    # Another node's name that this node's /etc/hosts puts on loopback is this node's fault.
    mapped = NameLookup("gpu09", ("MASTER_ADDR",), (HostsEntry("127.0.1.1", ("gpu09",), "/etc/hosts:3"),), ())
    (wrong,) = hostname_resolution_broken(facts_with(mapped, nodes=2))
    assert wrong.severity is None
    sss = lookup("gpu02", dns="NXDOMAIN")
    found = {o.subject: o for o in hostname_resolution_broken(facts_with(sss, order="hosts: sss dns"))}
    assert {subject: o.status for subject, o in found.items()} == {"gpu01": Status.UNKNOWN, "gpu02": Status.UNKNOWN}
    assert "'sss' cannot be emulated" in found["gpu02"].reason
    agree = lookup("gpu02", hosts=("10.0.0.2",), dns=("10.0.0.2",))
    assert list(hostname_resolution_broken(facts_with(agree))) == []
    reverse_ok = replace(agree, reverse=(DnsAnswer("10.0.0.2", "PTR", names=("GPU02.test.cluster.",)),))
    assert list(hostname_resolution_broken(facts_with(reverse_ok))) == []


def test_loopback_host_name_in_a_job_of_one_node_is_a_warning() -> None:
    """The host's own name on loopback breaks the cross-node paths (Gloo, c10d advertise it); a
    job of one node has none, so its prolog warns instead of requeueing it. Outside a job (a
    health check, an operator's run) and in a job of several nodes it stays an error."""
    def judged(nodes: int) -> Observation:
        facts = HostnameFacts("gpu01", (HostsEntry("127.0.1.1", ("gpu01",), "/etc/hosts:3"),), (), (), nodes_in_job=nodes)
        (finding,) = [o for o in hostname_resolution_broken(facts) if o.subject == "gpu01"]
        return finding

    assert judged(1).severity is Severity.WARNING and judged(2).severity is None and judged(0).severity is None
    assert "runs on one node" in judged(1).fix and judged(1).evidence[0].source == "/etc/hosts:3"


def test_loopback_host_name_with_gloo_socket_ifname_is_a_warning() -> None:
    """The host name's loopback address hurts a job through Gloo's default device; with
    GLOO_SOCKET_IFNAME naming an interface (PyTorch reads it when longer than one character) Gloo
    never uses it, and torch elastic publishes the name, which peers resolve themselves."""
    def severity(gloo: str) -> Severity | None:
        facts = HostnameFacts("gpu01", (HostsEntry("127.0.1.1", ("gpu01",), "/etc/hosts:3"),), (), (), nodes_in_job=4, gloo_socket_ifname=gloo)
        (finding,) = [o for o in hostname_resolution_broken(facts) if o.subject == "gpu01"]
        assert "advertises it unless GLOO_SOCKET_IFNAME" in finding.evidence[0].expected
        return finding.severity

    assert severity("ib0") is Severity.WARNING and severity("") is None


@pytest.mark.parametrize(
    ("environ", "nodes", "count"),
    [
        ({"SLURM_JOB_NODELIST": "gpu[01-06]"}, 6, 6),
        # Single-node runs inside a six-node allocation: the step's count is the job's.
        ({"SLURM_JOB_NODELIST": "gpu[01-06]", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "gpu01", "SLURM_STEP_NUM_NODES": "1"}, 1, 1),
        ({"SLURM_JOB_NODELIST": "gpu[01-06]", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2"}, 6, 2),
        ({"SLURM_JOB_NODELIST": "gpu[01-06]", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "\u00b2"}, 6, 6),
        ({"SLURM_JOB_NODELIST": "gpu[01-06]", "SLURM_STEP_NUM_NODES": "1"}, 6, 6),  # no step: the allocation's
        # The batch script (-5) and an salloc shell (-6) stand for the whole job, from which it starts
        # its multi-node steps; so does the unsigned form of those ids.
        ({"SLURM_JOB_NODELIST": "gpu[01-06]", "SLURM_STEP_ID": "-5", "SLURM_STEP_NODELIST": "gpu01", "SLURM_STEP_NUM_NODES": "1"}, 6, 6),
        ({"SLURM_JOB_NODELIST": "gpu[01-06]", "SLURM_STEP_ID": "-6", "SLURM_STEP_NODELIST": "gpu01", "SLURM_STEP_NUM_NODES": "1"}, 6, 6),
        ({"SLURM_JOB_NODELIST": "gpu[01-06]", "SLURM_STEP_ID": "4294967291", "SLURM_STEP_NUM_NODES": "1"}, 6, 6),
        # A part of a heterogeneous job lists its own node; one srun across the parts is one world.
        ({"SLURM_JOB_NODELIST": "gpu01", "SLURM_HET_JOB_ID": "7", "SLURM_JOB_ID": "8"}, 1, 0),
        # Outside Slurm, each launcher's counts: torchrun, Open MPI's mpirun, Hydra, DeepSpeed
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, 0, 1),
        ({"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, 0, 1),
        ({"OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, 0, 0),
        ({"PMI_SIZE": "4", "MPI_LOCALNRANKS": "4"}, 0, 1),
        ({"CROSS_SIZE": "1", "WORLD_SIZE": "8", "LOCAL_SIZE": "8"}, 0, 1),
        ({"CROSS_SIZE": "2", "WORLD_SIZE": "16", "LOCAL_SIZE": "8"}, 0, 2),
        # Kubeflow's training operator passes torchrun's --nnodes as PET_NNODES ("N" or "MIN:MAX")
        ({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "8", "WORLD_SIZE": "1", "RANK": "0"}, 0, 1),
        ({"PET_NNODES": "1:4", "PET_NPROC_PER_NODE": "8"}, 0, 4),
        ({"PET_NNODES": "x"}, 0, 0),
    ],
)
def test_the_job_step_decides_how_many_nodes_the_job_has(environ: dict[str, str], nodes: int, count: int) -> None:
    from preflight.probes.job import parse_environ

    assert parse_environ(b"".join(f"{k}={v}".encode() + b"\0" for k, v in environ.items())) == environ  # the job probe keeps them
    found, number, error = job_nodes(environ)
    assert (len(found), number, error) == (nodes, count, "")


def test_a_kubernetes_pods_ptr_records_are_the_cluster_dns_names(run_cli: Runner, server: PlantedDns, tmp_path: Path) -> None:
    """In a pod (kubelet's header on /etc/hosts) an address's PTR record names what the cluster DNS
    gives it (a headless service's name for a KubeRay head), never the pod: no mismatch warning."""
    root = tmp_path / "node"
    shutil.copytree(DNS_PEERS, root)
    settings = config(tmp_path, [LIVE], server.port)
    assert dns001(run_cli, root, "--config", settings)["gpu02"]["evidence"][0]["source"] == "DNS PTR 10.0.0.2"
    hosts = root / "etc" / "hosts"
    hosts.write_text("# Kubernetes-managed hosts file.\n" + hosts.read_text())
    assert "gpu02" not in dns001(run_cli, root, "--config", settings)


def test_loopback_host_name_in_a_one_node_step_of_a_larger_allocation(run_cli: Runner, tmp_path: Path) -> None:
    root = tmp_path / "node"
    shutil.copytree(DNS_PEERS, root)
    write(root, "/etc/hosts", "127.0.0.1 localhost\n127.0.1.1 gpu01.test.cluster gpu01\n")
    variables = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[01-06]", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "gpu01", "SLURM_STEP_NUM_NODES": "1"}
    write(root, "/proc/self/environ", "".join(f"{k}={v}\0" for k, v in variables.items()).encode())
    found = dns001(run_cli, root)
    assert (found["gpu01"]["status"], found["gpu01"]["severity"]) == ("present", "warning"), found["gpu01"]
    assert "runs on one node" in str(found["gpu01"]["fix"])


def test_a_name_with_no_record_drains_only_when_it_is_this_hosts() -> None:
    """No record for this host's own name is this node's fault (an error); none for a peer or
    MASTER_ADDR is missing for every node alike, and draining each node that looks it up would
    drain the cluster for one entry: a warning."""
    missing = (DnsAnswer("gpu01", "A", error="NXDOMAIN"), DnsAnswer("gpu01", "AAAA", error="NXDOMAIN"))
    peer = NameLookup("gpu02", ("MASTER_ADDR", "peer"), (), (DnsAnswer("gpu02", "A", error="NXDOMAIN"), DnsAnswer("gpu02", "AAAA", error="NXDOMAIN")), ())
    facts = HostnameFacts("gpu01", (), missing, (), peers=(peer,), nodes_in_job=2)
    found = {o.subject: o.severity for o in hostname_resolution_broken(facts)}
    assert found == {"gpu01": None, "gpu02": Severity.WARNING}


def test_nameserver_judgements() -> None:
    def judged(*checks: NameserverCheck) -> dict[str, object]:
        facts = replace(facts_with(), nameservers=checks)
        return {o.subject: o.severity for o in hostname_resolution_broken(facts)}

    fine = NameserverCheck("10.0.0.2", "NOERROR", 0.002)
    dead = NameserverCheck("10.0.0.3", error="TIMEOUT", detail="no answer within 2 s")
    assert judged(fine) == {}
    assert judged(fine, dead) == {"nameserver 10.0.0.3": Severity.WARNING}
    assert judged(dead) == {"nameserver 10.0.0.3": None}  # nobody answers: the reference's error
    assert judged(fine, NameserverCheck("10.0.0.4", "REFUSED", 0.001)) == {"nameserver 10.0.0.4": Severity.WARNING}


def test_peer_sample_covers_the_job_without_asking_everyone() -> None:
    nodes = [f"gpu{n:03d}" for n in range(1, 101)]
    peers = select_peers("gpu050", nodes, "gpu001")
    assert [name for name, _ in peers] == ["gpu001", "gpu051", "gpu052", "gpu053", "gpu054", "gpu055", "gpu056"]
    assert peers[0][1] == ("MASTER_ADDR", "peer")
    assert [name for name, _ in select_peers("gpu100", nodes, "10.0.0.1")][:2] == ["gpu001", "gpu002"]  # wraps
    asked = {name for host in nodes for name, _ in select_peers(host, nodes, "")}
    assert asked == set(nodes)


def test_parse_resolv_conf_options() -> None:
    conf = parse_resolv_conf("nameserver 127.0.0.53\noptions edns0 trust-ad ndots:20 timeout:0 attempts:9\nsearch .\n")
    assert (conf.ndots, conf.search) == (15, (".",))


def test_a_torchrun_job_outside_slurm_counts_its_nodes() -> None:
    """torchrun --standalone (or one agent) runs every rank on this node: a host name on loopback
    reaches them all, as for a one-node Slurm job (a warning, not a drain)."""
    from preflight.probes.hostname import job_nodes

    assert job_nodes({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}) == ([], 1, "")
    assert job_nodes({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) == ([], 0, "")
    assert job_nodes({"GROUP_WORLD_SIZE": "2", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) == ([], 2, "")
    assert job_nodes({}) == ([], 0, "") and job_nodes({"WORLD_SIZE": "0", "LOCAL_WORLD_SIZE": "0"}) == ([], 0, "")
    assert job_nodes({"SLURM_JOB_NODELIST": "gpu[01-02]", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"})[1] == 2  # Slurm's word wins


def test_same_host_accepts_a_relative_name_the_search_domains_complete() -> None:
    from preflight.probes.hostname import same_host

    assert same_host("gpu01", "GPU01.cluster.local.") and same_host("gpu01.cluster.local", "gpu01")
    assert same_host("trainer-master-0.trainer", "trainer-master-0.trainer.default.svc.cluster.local.")
    assert not same_host("gpu01", "gpu011.cluster.local") and not same_host("gpu01.a", "gpu01.b.a")
    assert not same_host("node-1.ib", "node-1.eth.cluster")


@pytest.mark.parametrize(
    ("gai_conf", "ipv6_usable", "first", "status"),
    [
        (None, True, "2001:db8:10::18", None),  # glibc's defaults: global IPv6 (40) before IPv4 (10)
        ("precedence ::ffff:0:0/96 100\n", True, "127.0.1.1", Status.PRESENT),  # Debian's "prefer IPv4" line
        (None, False, "127.0.1.1", Status.PRESENT),  # no global IPv6 address to send from: unusable, last
        (None, None, "2001:db8:10::18", Status.UNKNOWN),  # /proc/net/if_inet6 unread: order unknown
    ],
)
def test_a_loopback_line_matters_only_where_getaddrinfo_puts_it_first(
    gai_conf: str | None, ipv6_usable: bool | None, first: str, status: Status | None
) -> None:
    """Debian's '127.0.1.1 <host>' beside the node's IPv6 line: glibc returns the global IPv6
    address first unless /etc/gai.conf raises IPv4 (measured with glibc 2.36), and Gloo binds the
    first address, so the loopback line hurts only where it comes first."""
    from preflight.gai import parse_precedence

    entries = (HostsEntry("127.0.1.1", ("gpu018",), "/etc/hosts:2"), HostsEntry("2001:db8:10::18", ("gpu018",), "/etc/hosts:3"))
    facts = HostnameFacts("gpu018", entries, (), (), nodes_in_job=4, gai_precedence=parse_precedence(gai_conf or ""), ipv6_usable=ipv6_usable)
    lookup = NameLookup("gpu018", ("host",), entries, ())
    assert libc_lookup(lookup, facts).addresses[0] == first
    found = [o for o in hostname_resolution_broken(facts) if o.subject == "gpu018"]
    assert [o.status for o in found] == ([] if status is None else [status])
    if status is Status.PRESENT:
        assert found[0].severity is None and found[0].evidence[0].source == "/etc/hosts:2"
    if status is Status.UNKNOWN:
        assert "/proc/net/if_inet6 could not be read" in found[0].reason


def test_the_probe_reads_gai_conf_and_the_nodes_ipv6_addresses(tmp_path: Path) -> None:
    root = tmp_path / "node"
    write(root, "proc/sys/kernel/hostname", "gpu018\n")
    write(root, "etc/hosts", "127.0.0.1 localhost\n127.0.1.1 gpu018\n2001:db8:10::18 gpu018\n")
    write(root, "etc/nsswitch.conf", "hosts: files\n")
    write(root, "proc/net/if_inet6", "00000000000000000000000000000001 01 80 10 80       lo\n"
          "20010db8001000000000000000000018 02 40 00 80     eno1\nfe800000000000000e42a1fffe5e8a10 02 40 20 80     eno1\n")
    facts = probe_hostname(NodeFS(str(root)), Sources.for_fs(NodeFS(str(root))).dns, HostConfig())  # a root without DNS answers
    assert (facts.ipv6_usable, facts.gai_precedence, facts.gai_error) == (True, None, "")
    write(root, "etc/gai.conf", "# prefer IPv4\nprecedence ::ffff:0:0/96  100\n")
    write(root, "proc/net/if_inet6", "00000000000000000000000000000001 01 80 10 80       lo\n")
    facts = probe_hostname(NodeFS(str(root)), Sources.for_fs(NodeFS(str(root))).dns, HostConfig())
    assert (facts.ipv6_usable, facts.gai_precedence) == (False, (("::ffff:0:0/96", 100),))


def test_the_rendezvous_host_of_a_kubeflow_job() -> None:
    """Kubeflow's training operator names an elastic job's rendezvous in PET_RDZV_ENDPOINT
    ("host:port") and a static one's in PET_MASTER_ADDR, with no MASTER_ADDR: that host is the
    peer every node resolves and routes to (DNS001, NET004)."""
    from preflight.probes.job import rendezvous_host, parse_environ
    from preflight.probes.routing import collect_peers

    assert rendezvous_host({"MASTER_ADDR": "a", "PET_RDZV_ENDPOINT": "b:29400"}) == ("a", "MASTER_ADDR")
    assert rendezvous_host({"PET_RDZV_ENDPOINT": "train-worker-0:23456"}) == ("train-worker-0", "PET_RDZV_ENDPOINT")
    assert rendezvous_host({"PET_RDZV_ENDPOINT": "[fd00::5]:23456"}) == ("fd00::5", "PET_RDZV_ENDPOINT")
    assert rendezvous_host({"PET_RDZV_ENDPOINT": "fd00::5"}) == ("fd00::5", "PET_RDZV_ENDPOINT")
    assert rendezvous_host({"PET_MASTER_ADDR": "train-master-0"}) == ("train-master-0", "PET_MASTER_ADDR")
    assert rendezvous_host({}) == ("", "")
    environ = parse_environ(b"PET_RDZV_ENDPOINT=train-worker-0:23456\0PET_NNODES=2:4\0")
    assert collect_peers(environ, "", (), "train-worker-1") == ({"train-worker-0": ["PET_RDZV_ENDPOINT"]}, [])


def test_a_ptr_made_from_the_address_is_no_disagreement() -> None:
    """A cloud's DNS names every private address after itself (AWS: ip-10-1-42-17.ec2.internal),
    while ParallelCluster names the node after its Slurm node: that PTR names the address, not
    another host. A PTR naming another host still disagrees."""
    from types import SimpleNamespace

    from preflight.checks.dns import _names_the_address, _reverse_mismatches

    assert _names_the_address("ip-10-1-42-17.ec2.internal.", "10.1.42.17")
    assert _names_the_address("10-1-42-17.gpu.example.", "10.1.42.17")
    assert not _names_the_address("gpu99.test.cluster.", "10.0.0.2")
    assert not _names_the_address("ip-10-1-42-170.ec2.internal.", "10.1.42.1")  # another address that begins alike
    lookup = SimpleNamespace(name="p6-b200-st-p6-1", reverse=[SimpleNamespace(name="10.1.42.17", names=["ip-10-1-42-17.ec2.internal."])])
    assert _reverse_mismatches(lookup) == []
    other = SimpleNamespace(name="gpu02", reverse=[SimpleNamespace(name="10.0.0.2", names=["gpu99.test.cluster."])])
    assert [e.observed for e in _reverse_mismatches(other)] == ["gpu99.test.cluster."]
