"""SOCK001 and SOCK005: /proc/net/tcp{,6} and the ephemeral port sysctls, on short strings, on
recorded roots, on bad input, and on this machine's own kernel with real listening sockets."""

from __future__ import annotations

import json
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO, Runner, write
from preflight.probes.job import JobFacts, probe_job
from preflight.probes.sockets import Destination, ListeningSocket, SocketFacts, TableError, parse_port_range, parse_reserved_ports, job_master_port, parse_tcp_table, probe_sockets
from preflight.checks.sock import ephemeral_port_exhaustion, rendezvous_port_in_use
from preflight.model import Severity, Status
from preflight.sources import NodeFS

PORTS_EXHAUSTED = REPO / "tests" / "fixtures" / "nodes" / "ports-exhausted"
HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
HEADER6 = ("  sl  local_address                         remote_address                        st tx_queue "
           "rx_queue tr tm->when retrnsmt   uid  timeout inode\n")
LISTEN_29500 = "   0: 0100007F:733C 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1001        0 4711 1 0000000000000000 100 0 0 10 0\n"
TIME_WAIT = "   1: 0100007F:C350 0100007F:733C 06 00000000:00000000 03:00000D3F 00000000     0        0 0 3 0000000000000000\n"


def job(**environ: str) -> JobFacts:
    return JobFacts(environ, "", ())


def findings(run_cli: Runner, root: Path, *extra: str, env: dict[str, str] | None = None) -> dict[str, dict[str, object]]:
    result = run_cli("node", "--root", str(root), "--format", "json", "--select", "SOCK", *extra, env=env)
    assert "Traceback" not in result.stderr, result.stderr
    return {f["id"]: f for f in json.loads(result.stdout)["findings"]}


# -- parsers --------------------------------------------------------------------------------------
def test_parse_tcp_table_decodes_addresses_ports_and_states() -> None:
    table = parse_tcp_table(HEADER + LISTEN_29500 + TIME_WAIT, "/proc/net/tcp", (32768, 60999))
    assert table.listening == (ListeningSocket("127.0.0.1", 29500, 1001, 4711, "/proc/net/tcp:2"),)
    assert table.states == {"LISTEN": 1, "TIME_WAIT": 1}
    assert table.local_ports == {29500, 50000}
    assert table.destinations == {("127.0.0.1", 29500): 1}
    assert (table.bad_lines, table.bad_count) == ((), 0)


def test_parse_tcp6_table() -> None:
    line = "   0: 00000000000000000000000001000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 99 1 0000000000000000 100 0 0 10 0\n"
    mapped = "   1: 0000000000000000FFFF00000100007F:1F91 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 98 1 0000000000000000 100 0 0 10 0\n"
    table = parse_tcp_table(HEADER6 + line + mapped, "/proc/net/tcp6")
    assert [(s.address, s.port) for s in table.listening] == [("::1", 8080), ("::ffff:127.0.0.1", 8081)]


def test_garbage_lines_are_kept_aside() -> None:
    text = HEADER + "garbage\n" + LISTEN_29500 + "   2: ZZZZ:0016 00000000:0000 0A 0 0 0 0 0 0\n" + "   3: 0100007F:0016 0100007F:0017 FF 0 0 0 0 0 0\n"
    table = parse_tcp_table(text, "/proc/net/tcp")
    assert table.bad_count == 3 and len(table.listening) == 1
    assert table.bad_lines[0].startswith("/proc/net/tcp:2: fewer than 10 fields")
    assert "unknown state FF" in table.bad_lines[2]
    with pytest.raises(TableError):
        parse_tcp_table("hello\n" + LISTEN_29500, "/proc/net/tcp")
    with pytest.raises(TableError):
        parse_tcp_table("", "/proc/net/tcp")


def test_parse_port_settings() -> None:
    assert parse_port_range("32768\t60999\n") == (32768, 60999)
    for bad in ("", "32768", "a b", "60999 32768", "0 10", "1 70000"):
        with pytest.raises(ValueError):
            parse_port_range(bad)
    assert parse_reserved_ports("\n") == ()
    assert parse_reserved_ports("29400,29500-29510\n") == ((29400, 29400), (29500, 29510))
    with pytest.raises(ValueError):
        parse_reserved_ports("29400,x")


# -- recorded roots -----------------------------------------------------------------------------
def test_probe_on_the_exhausted_root() -> None:
    facts = probe_sockets(NodeFS(str(PORTS_EXHAUSTED)), probe_job(NodeFS(str(PORTS_EXHAUSTED))))
    assert facts == SocketFacts(
        port_range=(50000, 50999),
        reserved=(),
        listening=(
            ListeningSocket("0.0.0.0", 22, 0, 21786, "/proc/net/tcp:2"),
            ListeningSocket("0.0.0.0", 29500, 1002, 991234, "/proc/net/tcp:3"),
        ),
        states={"LISTEN": 2, "TIME_WAIT": 600, "ESTABLISHED": 250},
        ephemeral_ports_in_use=850,
        ephemeral_ports_open=250,  # the TIME_WAIT sockets' ports are the kernel's to free
        busiest=(Destination("10.0.0.9", 29500, 850),),
        busiest_open=250,
        tables=("/proc/net/tcp",),  # no tcp6: IPv6 disabled, not a problem
        bad_lines=(),
        bad_line_count=0,
        problems=(),
        hostname="gpu07",
        addresses=None,  # the recording has no /proc/net/fib_trie
    )


def test_exhausted_root_through_the_cli(run_cli: Runner) -> None:
    found = findings(run_cli, PORTS_EXHAUSTED)
    sock001, sock005 = found["SOCK001"], found["SOCK005"]
    # The job names no MASTER_PORT: 29500 is a guess, and the listener may be a running job's own.
    assert (sock001["status"], sock001["severity"], sock001["subject"]) == ("present", "warning", "port 29500")
    assert sock001["evidence"][0]["source"] == "/proc/net/tcp:3"
    assert sock001["evidence"][0]["observed"].startswith("0.0.0.0:29500 LISTEN (uid 1002, inode 991234); MASTER_PORT unset")
    # 85 % of the range is held, but 600 of those ports only by TIME_WAIT sockets that are gone
    # within a minute: a warning about the narrow range and the pressure, not a drain.
    assert (sock005["status"], sock005["severity"]) == ("present", "warning")
    assert [e["observed"] for e in sock005["evidence"]] == [
        "50000 50999: 1000 usable ports",
        "850 of 1000 ephemeral ports held (250 ESTABLISHED, 600 TIME_WAIT); 850 sockets to 10.0.0.9:29500;"
        " 600 only by closed sockets the kernel frees within about a minute",
    ]


def test_ports_held_by_open_sockets_are_an_error(run_cli: Runner, tmp_path: Path) -> None:
    """The same table with the TIME_WAIT sockets still established: those ports stay taken."""
    root = tmp_path / "node"
    shutil.copytree(PORTS_EXHAUSTED, root)
    table = (root / "proc/net/tcp").read_text()
    (root / "proc/net/tcp").write_text(table.replace(" 06 00000000:00000000 ", " 01 00000000:00000000 "))
    sock005 = findings(run_cli, root)["SOCK005"]
    assert (sock005["status"], sock005["severity"]) == ("present", "error")
    assert sock005["evidence"][1]["observed"] == (
        "850 of 1000 ephemeral ports held (850 ESTABLISHED, 0 TIME_WAIT); 850 sockets to 10.0.0.9:29500"
    )


def test_a_listener_on_the_port_the_job_names_is_an_error(run_cli: Runner, tmp_path: Path) -> None:
    root = tmp_path / "node"
    shutil.copytree(PORTS_EXHAUSTED, root)
    write(root, "/proc/self/environ", b"SLURM_JOB_ID=9\0MASTER_PORT=29500\0")
    sock001 = findings(run_cli, root)["SOCK001"]
    assert (sock001["status"], sock001["severity"]) == ("present", "error")
    assert sock001["evidence"][0]["observed"].startswith("0.0.0.0:29500 LISTEN (uid 1002, inode 991234); MASTER_PORT=29500 (job environment)")
    # A rank of the job whose own user holds the port: the job's own store (rank 0 of env://
    # binds it before a Ray Train function runs) or a stale process of that user: a warning.
    write(root, "/proc/self/status", "Name:\tpython\nUid:\t1002\t1002\t1002\t1002\nGid:\t1002\t1002\t1002\t1002\nGroups:\t1002\n")
    sock001 = findings(run_cli, root)["SOCK001"]
    assert (sock001["status"], sock001["severity"]) == ("present", "warning")
    assert "the job's own store, or a stale process of the same user" in json.dumps(sock001["evidence"])
    # A torchrun worker: MASTER_PORT is the store its own agent already serves there.
    write(root, "/proc/self/environ", b"SLURM_JOB_ID=9\0MASTER_PORT=29500\0TORCHELASTIC_USE_AGENT_STORE=True\0TORCHELASTIC_RUN_ID=7\0")
    assert findings(run_cli, root)["SOCK001"]["status"] == "absent"


FIB_TRIE = """Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 0.0.0.0
        /0 universe UNICAST
     +-- 10.0.0.0/24 2 0 2
        |-- 10.0.0.7
           /32 host LOCAL
"""


def test_own_addresses_are_read_only_where_something_listens_on_the_jobs_port(tmp_path: Path) -> None:
    """The prolog asks whether this node hosts the store only for a listener on the job's port:
    otherwise the host name and the routing table (large on hosts with many routes) stay unread."""
    root = tmp_path / "node"
    shutil.copytree(PORTS_EXHAUSTED, root)
    write(root, "/proc/net/fib_trie", FIB_TRIE)
    for port, read in (("29500", True), ("29511", False)):
        write(root, "/proc/self/environ", f"SLURM_JOB_ID=9\0MASTER_PORT={port}\0".encode())
        fs = NodeFS(str(root))
        facts = probe_sockets(fs, probe_job(fs))
        assert (facts.addresses is not None, facts.hostname is not None) == (read, read), port
        assert read is ("10.0.0.7" in (facts.addresses or ()))


@pytest.mark.parametrize(
    ("environ", "severity"),
    [
        # Another node hosts the store: the listener (another job's) is in nobody's way here.
        ({"MASTER_ADDR": "gpu01", "RANK": "8"}, "warning"),
        ({"MASTER_ADDR": "10.0.0.1"}, "warning"),
        # This node binds the port.
        ({"MASTER_ADDR": "gpu07", "RANK": "8"}, "error"),
        ({"MASTER_ADDR": "GPU07.cluster.example."}, "error"),
        ({"MASTER_ADDR": "10.0.0.7"}, "error"),
        ({"MASTER_ADDR": "localhost"}, "error"),
        ({"MASTER_ADDR": "127.0.0.1"}, "error"),
        ({"MASTER_ADDR": "gpu01", "RANK": "0"}, "error"),
        ({"MASTER_ADDR": "gpu01", "GROUP_RANK": " 0 "}, "error"),
        ({"MASTER_ADDR": "gpu01", "SLURM_NODEID": "0"}, "error"),
    ],
)
def test_a_listener_is_an_error_only_on_the_node_that_binds_the_port(
    run_cli: Runner, tmp_path: Path, environ: dict[str, str], severity: str
) -> None:
    """Only the store's host binds MASTER_PORT (env:// on rank 0, torchrun on node rank 0, the c10d
    backend where the endpoint is this machine); on the other nodes of the job a listener there,
    another job's on a shared node, takes nothing from the job."""
    root = tmp_path / "node"
    shutil.copytree(PORTS_EXHAUSTED, root)
    write(root, "/proc/net/fib_trie", FIB_TRIE)
    variables = {"SLURM_JOB_ID": "9", "MASTER_PORT": "29500", **environ}
    write(root, "/proc/self/environ", "".join(f"{k}={v}\0" for k, v in variables.items()).encode())
    sock001 = findings(run_cli, root)["SOCK001"]
    assert (sock001["status"], sock001["severity"]) == ("present", severity), sock001
    if severity == "warning":
        assert sock001["evidence"][1]["source"] == "MASTER_ADDR" and "another host" in sock001["evidence"][1]["observed"]


def test_master_port_inside_the_range_unless_reserved(run_cli: Runner, tmp_path: Path) -> None:
    root = tmp_path / "node"
    shutil.copytree(PORTS_EXHAUSTED, root)
    write(root, "/proc/self/environ", b"SLURM_JOB_ID=9\0MASTER_PORT=50500\0")
    sock001 = findings(run_cli, root)["SOCK001"]
    assert (sock001["status"], sock001["severity"], sock001["subject"]) == ("present", "warning", "port 50500")
    assert sock001["evidence"][0]["observed"] == (
        "50000 50999 contains 50500 (MASTER_PORT=50500 (job environment)); ip_local_reserved_ports: empty"
    )
    write(root, "/proc/sys/net/ipv4/ip_local_reserved_ports", "50500,50600-50610\n")
    assert findings(run_cli, root)["SOCK001"]["status"] == "absent"


def test_clean_example_root_is_absent(run_cli: Runner, clean_root: Path) -> None:
    found = findings(run_cli, clean_root)
    assert {ref: f["status"] for ref, f in found.items()} == {"SOCK001": "absent", "SOCK002": "absent", "SOCK004": "absent", "SOCK005": "absent"}


# -- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "content", "reason"),
    [
        ("proc/net/tcp", None, "/proc/net/tcp: not captured"),
        ("proc/net/tcp", b"", "not a /proc/net/tcp table"),
        ("proc/net/tcp", b"\xff\xfe\x00garbage\x80\n" * 50, "not UTF-8 text"),
        ("proc/net/tcp", HEADER + "   0: 0100007F:733C\n" + "nonsense here\n", "2 unparseable lines"),
        ("proc/net/tcp", "directory", "is a directory"),
    ],
)
def test_unreadable_tables_are_unknown_with_the_reason(
    run_cli: Runner, clean_root: Path, path: str, content: str | bytes | None, reason: str
) -> None:
    target = clean_root / path
    target.unlink()
    if content == "directory":
        target.mkdir()
    elif content is not None:
        write(clean_root, path, content)
    found = findings(run_cli, clean_root)
    for ref in ("SOCK001", "SOCK005"):
        assert found[ref]["status"] == "unknown" and reason in str(found[ref]["reason"]), found[ref]


@pytest.mark.parametrize("content", [b"29400,29500\x00garbage\n", b"\xff\xfe\n", None], ids=["garbled", "not UTF-8", "missing"])
def test_unread_reserved_ports_are_unknown_not_nothing_reserved(run_cli: Runner, clean_root: Path, content: bytes | None) -> None:
    """Reserved ports are no ephemeral ports: an ip_local_reserved_ports that cannot be read says
    nothing about which ports the kernel hands out, and reading it as empty was a guess."""
    (clean_root / "proc/sys/net/ipv4/ip_local_reserved_ports").unlink()
    if content is not None:
        write(clean_root, "/proc/sys/net/ipv4/ip_local_reserved_ports", content)
    write(clean_root, "/proc/self/environ", b"SLURM_JOB_ID=9\0MASTER_PORT=40000\0")  # inside 32768-60999
    found = findings(run_cli, clean_root)
    for ref in ("SOCK001", "SOCK005"):
        assert found[ref]["status"] == "unknown" and "ip_local_reserved_ports" in str(found[ref]["reason"]), found[ref]
    write(clean_root, "/proc/self/environ", b"SLURM_JOB_ID=9\0MASTER_PORT=29500\0")  # outside it: no reservation needed
    assert findings(run_cli, clean_root)["SOCK001"]["status"] == "absent"


def test_garbage_line_does_not_hide_a_listener(run_cli: Runner, clean_root: Path) -> None:
    table = clean_root / "proc/net/tcp"
    write(clean_root, "/proc/net/tcp", table.read_text() + "junk\n" + LISTEN_29500)
    assert findings(run_cli, clean_root)["SOCK001"]["status"] == "present"


def test_missing_tcp6_is_fine_but_a_bad_port_range_is_unknown(run_cli: Runner, clean_root: Path) -> None:
    (clean_root / "proc/net/tcp6").unlink()
    assert {f["status"] for f in findings(run_cli, clean_root).values()} == {"absent"}
    write(clean_root, "/proc/sys/net/ipv4/ip_local_port_range", "lots of ports\n")
    found = findings(run_cli, clean_root)
    assert found["SOCK005"]["status"] == "unknown" and "expected two port numbers" in str(found["SOCK005"]["reason"])
    assert found["SOCK001"]["status"] == "unknown" and "ip_local_port_range" in str(found["SOCK001"]["reason"])


def test_bad_master_port_is_unknown() -> None:
    facts = probe_sockets(NodeFS(str(PORTS_EXHAUSTED)), probe_job(NodeFS(str(PORTS_EXHAUSTED))))
    (observation,) = rendezvous_port_in_use(facts, job(MASTER_PORT="twenty"))
    assert observation.status is Status.UNKNOWN and observation.subject == "MASTER_PORT"
    (observation,) = rendezvous_port_in_use(facts, JobFacts({}, "permission denied (EACCES); needs root", ()))
    assert observation.status is Status.UNKNOWN and "EACCES" in observation.reason


def test_exhaustion_thresholds_on_hand_built_facts() -> None:
    def facts(
        low: int, high: int, held: int, reserved: tuple[tuple[int, int], ...] = (), *, open_: int | None = None, busiest_open: int = 0,
    ) -> SocketFacts:
        held_open = held if open_ is None else open_
        states = {"ESTABLISHED": held_open, "TIME_WAIT": held - held_open}
        return SocketFacts((low, high), reserved, (), states, held, held_open, (), busiest_open, ("/proc/net/tcp",), (), 0, ())

    assert list(ephemeral_port_exhaustion(facts(32768, 60999, 1000))) == []
    (half,) = ephemeral_port_exhaustion(facts(32768, 60999, 15000))
    assert half.severity is Severity.WARNING
    (full,) = ephemeral_port_exhaustion(facts(32768, 60999, 25000))
    assert full.severity is None  # the reference's error
    (after_a_job,) = ephemeral_port_exhaustion(facts(32768, 60999, 25000, open_=3000))
    assert after_a_job.severity is Severity.WARNING  # TIME_WAIT frees itself: no drain
    # Open sockets to one endpoint exhaust connect() to it even when few ports are distinct.
    (one_endpoint,) = ephemeral_port_exhaustion(facts(32768, 60999, 25000, open_=3000, busiest_open=24000))
    assert one_endpoint.severity is None
    (narrow,) = ephemeral_port_exhaustion(facts(50000, 51000, 10))
    assert narrow.severity is Severity.WARNING and narrow.evidence[0].observed == "50000 51000: 1001 usable ports"
    (all_reserved,) = ephemeral_port_exhaustion(facts(50000, 50009, 0, reserved=((50000, 50009),)))
    assert all_reserved.severity is None


# -- the live kernel -----------------------------------------------------------------------------------
@pytest.fixture
def listener() -> Iterator[socket.socket]:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen()
    yield server
    server.close()


def test_live_proc_net_tcp_finds_a_real_listener(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port)):
        accepted, _ = listener.accept()
        facts = probe_sockets(NodeFS("/"), probe_job(NodeFS("/")))
        accepted.close()
    assert any(s.address == "127.0.0.1" and s.port == port for s in facts.listening)
    assert facts.states.get("ESTABLISHED", 0) >= 2 and "/proc/net/tcp" in facts.tables
    assert facts.port_range is not None and facts.bad_line_count == 0
    (observation,) = rendezvous_port_in_use(facts, job(MASTER_PORT=str(port)))
    assert observation.subject == f"port {port}" and observation.severity is None


def test_live_time_wait_port_is_held_but_not_open(listener: socket.socket) -> None:
    """The side that closes first keeps its port in TIME_WAIT: the real kernel's line for it
    counts as held and not as open."""
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    client_port = client.getsockname()[1]
    client.close()  # FIN from the client first: the client's end goes to TIME_WAIT
    accepted.recv(1)  # reads the FIN
    accepted.close()
    deadline = time.monotonic() + 5
    table = parse_tcp_table(Path("/proc/net/tcp").read_text(), "/proc/net/tcp", (1, 65535))
    while time.monotonic() < deadline and table.states.get("TIME_WAIT", 0) == 0:
        time.sleep(0.05)  # the last ACK crosses loopback asynchronously
        table = parse_tcp_table(Path("/proc/net/tcp").read_text(), "/proc/net/tcp", (1, 65535))
    assert client_port in table.local_ports and client_port not in table.open_local_ports


def test_live_cli_sees_the_port_the_job_wants_taken(run_cli: Runner, listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    result = run_cli("node", "--format", "json", "--select", "SOCK001", env={"MASTER_PORT": str(port)})
    (finding,) = json.loads(result.stdout)["findings"]
    assert (finding["status"], finding["subject"]) == ("present", f"port {port}")
    assert finding["evidence"][0]["source"].startswith("/proc/net/tcp:")
    assert finding["evidence"][0]["observed"].startswith(f"127.0.0.1:{port} LISTEN")


def test_live_ipv6_listener_is_read_from_tcp6() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this Python")
    try:
        server = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        server.bind(("::1", 0))
    except OSError as error:
        pytest.skip(f"cannot bind ::1 here: {error}")
    with server:
        server.listen()
        port = server.getsockname()[1]
        facts = probe_sockets(NodeFS("/"), probe_job(NodeFS("/")))
    assert any(s.address == "::1" and s.port == port and s.source.startswith("/proc/net/tcp6:") for s in facts.listening)


def test_usable_ports_counts_intervals_exactly() -> None:
    import random

    from preflight.checks.sock import usable_ports

    def by_enumeration(port_range: tuple[int, int], reserved: tuple[tuple[int, int], ...]) -> int:
        return sum(1 for port in range(port_range[0], port_range[1] + 1) if not any(a <= port <= b for a, b in reserved))

    generator = random.Random(7)
    for _ in range(300):
        low = generator.randint(1, 60000)
        port_range = (low, low + generator.randint(0, 3000))
        reserved = tuple((a, a + generator.randint(0, 400)) for a in (generator.randint(1, 64000) for _ in range(generator.randint(0, 6))))
        assert usable_ports(port_range, reserved) == by_enumeration(port_range, reserved)


def test_a_listener_on_the_default_port_is_a_warning_that_says_to_look_first() -> None:
    """Where the job names no MASTER_PORT (a health check beside a running job, an operator's
    audit, a prolog) the listener on 29500 may be a running job's own store: a warning whose fix
    says to see whose it is before stopping anything."""
    table = parse_tcp_table(HEADER + LISTEN_29500, "/proc/net/tcp", (32768, 60999))
    facts = SocketFacts((32768, 60999), (), table.listening, {}, 0, 0, (), 0, ("/proc/net/tcp",), (), 0, ())
    (observation,) = rendezvous_port_in_use(facts, job())
    assert (observation.subject, observation.severity) == ("port 29500", Severity.WARNING)
    assert observation.fix.startswith("See whose the listener is") and "a job running on this node" in observation.fix


@pytest.mark.parametrize(
    ("environ", "port", "origin"),
    [
        # Kubeflow's elastic PyTorchJob: torchrun's c10d store binds the endpoint's port
        ({"PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "bert-master-0:23456"}, 23456, "PET_RDZV_ENDPOINT's port=23456 (job environment)"),
        ({"PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "[fd00::5]:23456"}, 23456, "PET_RDZV_ENDPOINT's port=23456 (job environment)"),
        ({"PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "bert-master-0"}, 29400, "PET_RDZV_ENDPOINT names no port: torchrun's c10d default 29400"),
        # a static one: the master port torchrun is given
        ({"PET_MASTER_ADDR": "bert-master-0", "PET_MASTER_PORT": "23456"}, 23456, "PET_MASTER_PORT=23456 (job environment)"),
        # MASTER_PORT, which env:// reads, comes first
        ({"MASTER_PORT": "1234", "PET_RDZV_ENDPOINT": "h:23456"}, 1234, "MASTER_PORT=1234 (job environment)"),
        ({"PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "h:http"}, None, "PET_RDZV_ENDPOINT's port='http' is not a port number"),
        ({"PET_RDZV_BACKEND": "etcd-v2", "PET_RDZV_ENDPOINT": "etcd:2379"}, None, "PET_RDZV_BACKEND='etcd-v2'"),
        ({}, 29500, "MASTER_PORT unset: torchrun's default 29500"),
    ],
)
def test_the_store_port_of_a_torchrun_job_launched_by_kubeflow(environ: dict[str, str], port: int | None, origin: str) -> None:
    """Kubeflow's training operator passes torchrun its arguments as PET_* variables, without
    MASTER_PORT for an elastic job: the port to look at is the one the job's store binds."""
    store = job_master_port(job(**environ))
    assert (store.port, store.named) == (port, bool(environ) or port is None)
    assert store.origin.startswith(origin)


def test_a_listener_on_an_elastic_jobs_endpoint_port_is_judged_on_that_port() -> None:
    """The endpoint names this host's port 29500 with a listener: the job named it, so on the
    store's host (the endpoint's node rank 0) it is an error, not the default port's warning."""
    table = parse_tcp_table(HEADER + LISTEN_29500, "/proc/net/tcp", (32768, 60999))
    facts = SocketFacts((32768, 60999), (), table.listening, {}, 0, 0, (), 0, ("/proc/net/tcp",), (), 0, ())
    environ = {"PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "bert-master-0:29500", "PET_NODE_RANK": "0"}
    (observation,) = rendezvous_port_in_use(facts, job(**environ))
    assert (observation.subject, observation.severity, observation.status) == ("port 29500", None, Status.PRESENT)
    assert not list(rendezvous_port_in_use(facts, job(PET_RDZV_BACKEND="c10d", PET_RDZV_ENDPOINT="bert-master-0:23456")))
