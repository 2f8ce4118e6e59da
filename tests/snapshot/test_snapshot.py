"""``preflight snapshot`` records what the probes read; ``preflight node --root OUT.tar.gz`` (and the
extracted directory) replays it with the same report: findings, statuses, evidence, probe
outcomes and facts. Recorded roots, the live node and a live network namespace are recorded and
replayed; the recording layer's own answers (errors, hangs, links) are tested on hand-made roots.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLE_ROOT, REPO, Runner, preflight_command, write

from preflight.cli.node import NODE, run_node
from preflight.cli.spec import values_for
from preflight.snapshot import MANIFEST, SnapshotArgs, take_snapshot
from preflight.sources import NodeFS, SourceError, Sources
from preflight.sources.archive import opened_root
from preflight.sources.dns import NameserverCheck, ReplayDns
from preflight.sources.nvml import NvmlError, ReplayNvml
from preflight.sources.recording import DERIVED_METHODS, RECORDED_METHODS, RecordingFS, record

FIXTURES = REPO / "tests" / "fixtures" / "nodes"
ROOTS = [EXAMPLE_ROOT, *sorted(path for path in FIXTURES.iterdir() if path.is_dir())]
VOLATILE = ("started_at", "duration_s", "root")


def normalised(report: dict[str, Any]) -> dict[str, Any]:
    """A JSON report without what differs between two runs of the same answers (timings, and
    the root, which names the archive on replay)."""
    for key in VOLATILE:
        report.pop(key)
    for probe in report["probes"]:
        probe.pop("duration_s")
    return report


def node_report(root: str | Path, capsys: pytest.CaptureFixture[str], **options: Any) -> dict[str, Any]:
    """``preflight node --root ROOT --format json`` in this process; the parsed report."""
    code = run_node(values_for(NODE, root=str(root), output_format="json", **options))
    captured = capsys.readouterr()
    assert code in (0, 1, 2), captured.err
    report: dict[str, Any] = json.loads(captured.out)
    return report


def test_enough_varied_roots_are_replayed() -> None:
    names = {root.name for root in ROOTS}
    assert len(names) >= 7
    assert {"hgx-h100", "efa-p4d", "roce-v1v2", "roce-pfc-misconfigured", "dns-peers", "dns-stub-container"} <= names


@pytest.mark.parametrize("root", ROOTS, ids=lambda path: path.name)
def test_snapshot_of_a_recorded_root_replays_to_the_same_report(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    direct = node_report(root, capsys)
    archive = tmp_path / f"{root.name}.tar.gz"
    result = take_snapshot(SnapshotArgs(output=str(archive), root=str(root)))
    replayed = node_report(archive, capsys)
    assert replayed["root"] == str(archive)
    assert normalised(replayed) == normalised(direct)
    assert result.snapshot.manifest["inexact"] == []
    assert result.snapshot.manifest["findings"] == [[f["id"], f["subject"], f["status"]] for f in direct["findings"]]


def test_extracted_snapshot_replays_like_the_archive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    archive = tmp_path / "node.tar.gz"
    take_snapshot(SnapshotArgs(output=str(archive), root=str(EXAMPLE_ROOT)))
    extracted = tmp_path / "extracted"
    extracted.mkdir()
    subprocess.run(["tar", "-xzf", str(archive), "-C", str(extracted)], check=True, timeout=60)
    assert normalised(node_report(extracted, capsys)) == normalised(node_report(EXAMPLE_ROOT, capsys))


def test_snapshot_layout_is_a_recorded_root(tmp_path: Path) -> None:
    archive = tmp_path / "node.tar.gz"
    take_snapshot(SnapshotArgs(output=str(archive), root=str(EXAMPLE_ROOT)))
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        links = {member.name: member.linkname for member in tar.getmembers() if member.issym()}
        manifest = json.loads(tar.extractfile(MANIFEST).read())  # type: ignore[union-attr]
        kmsg = tar.extractfile(".preflight/kmsg").read().decode()  # type: ignore[union-attr]
        devices = json.loads(tar.extractfile(".preflight/devices.json").read())  # type: ignore[union-attr]
    assert {".preflight/nvml.json", ".preflight/dns.json", "proc/self/environ", "proc/sys/kernel/hostname"} <= names
    assert not any(name.startswith(("/", "..")) or "/../" in name for name in names)
    # sysfs class entries stay symlinks into /sys/devices, as on the node
    assert links["sys/class/infiniband/mlx5_0"].startswith("../../devices/pci")
    # The example's log holds no record the kernel_log probe reads (Xids, link downs, refused
    # joins, lossless-buffer warnings): a snapshot keeps only those, so nothing.
    assert kmsg == "" and (EXAMPLE_ROOT / ".preflight" / "kmsg").read_text()
    assert devices["nodes"]["/dev/infiniband/uverbs0"]["type"] == "char"
    assert manifest["format"] == "preflight-snapshot/1" and manifest["profile"] == "full"
    assert manifest["source"] == "recorded root" and manifest["scrub"] == {"categories": []}
    assert str(EXAMPLE_ROOT) not in json.dumps(manifest)  # no path of the recording machine
    assert {"format", "preflight", "taken_at", "findings", "summary"} <= set(manifest)


def test_cli_snapshot_and_replay_of_the_example(run_cli: Runner, tmp_path: Path) -> None:
    archive = tmp_path / "gpu017.tar.gz"
    result = run_cli("snapshot", str(archive), "--root", str(EXAMPLE_ROOT))
    assert result.returncode == 0, result.stderr
    assert f"wrote {archive}" in result.stderr and f"preflight node --root {archive}" in result.stderr
    direct = run_cli("node", "--root", str(EXAMPLE_ROOT), "--format", "json")
    replayed = run_cli("node", "--root", str(archive), "--format", "json")
    assert replayed.returncode == direct.returncode == 2
    assert normalised(json.loads(replayed.stdout)) == normalised(json.loads(direct.stdout))
    table = run_cli("node", "--root", str(archive))
    assert f"root {archive}" in table.stdout and "preflight-replay-" not in table.stdout


def test_replay_leaves_no_temporary_copy(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    archive = tmp_path / "node.tar.gz"
    take_snapshot(SnapshotArgs(output=str(archive), root=str(EXAMPLE_ROOT)))
    # The replay unpacks into tempfile's directory ($TMPDIR, else /tmp): this test's own, so that
    # what other runs leave in /tmp meanwhile does not count.
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    with opened_root(str(archive)) as (directory, label):
        assert Path(directory).is_dir() and label == str(archive)
        assert Path(directory).parent.parent == scratch
        assert oct(Path(directory).parent.stat().st_mode & 0o777) == "0o700"
    node_report(archive, capsys)
    assert list(scratch.iterdir()) == []


def test_site_config_given_to_snapshot_is_replayed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "site.toml"
    config.write_text("[expect]\ngpu_count = 16\nmemlock_min = \"8MiB\"\n")
    direct = node_report(EXAMPLE_ROOT, capsys, config=str(config))
    archive = tmp_path / "node.tar.gz"
    take_snapshot(SnapshotArgs(output=str(archive), root=str(EXAMPLE_ROOT), config=str(config)))
    with tarfile.open(archive) as tar:  # kept as the record of what the node was judged with
        assert tar.extractfile("etc/preflight/preflight.toml").read() == config.read_bytes()  # type: ignore[union-attr]
    replayed = node_report(archive, capsys, config=str(config))
    assert normalised(replayed) == normalised(direct)
    assert ("GPU001", "present") in {(f["id"], f["status"]) for f in replayed["findings"]}  # 8 GPUs, 16 expected
    # A config inside a snapshot is evidence, never settings: without --config it is not obeyed.
    unconfigured = node_report(archive, capsys)
    assert unconfigured["config"] == "" and ("GPU001", "present") not in {(f["id"], f["status"]) for f in unconfigured["findings"]}


def test_snapshot_of_a_snapshot_is_the_same_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first, second = tmp_path / "first.tar.gz", tmp_path / "second.tar.gz"
    take_snapshot(SnapshotArgs(output=str(first), root=str(EXAMPLE_ROOT)))
    take_snapshot(SnapshotArgs(output=str(second), root=str(first)))
    assert normalised(node_report(second, capsys)) == normalised(node_report(EXAMPLE_ROOT, capsys))


def test_prolog_replay_of_a_full_snapshot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    archive = tmp_path / "node.tar.gz"
    take_snapshot(SnapshotArgs(output=str(archive), root=str(EXAMPLE_ROOT)))
    direct = node_report(EXAMPLE_ROOT, capsys, profile="prolog")
    assert normalised(node_report(archive, capsys, profile="prolog")) == normalised(direct)


# -- the live node ----------------------------------------------------------------------------
def test_live_node_snapshot_replays_to_the_recording_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """This machine, without --root: the replay gives the report of the run that recorded it
    (a second live run could differ: DNS timings, processes, the kernel log)."""
    archive = tmp_path / "live.tar.gz"
    result = take_snapshot(SnapshotArgs(output=str(archive)))
    recorded = result.snapshot.report.to_json()
    replayed = node_report(archive, capsys)
    assert normalised(replayed) == normalised(recorded)
    assert result.snapshot.manifest["source"] == "live node"
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    # the live answers the kernel gives only through APIs are in the recording files
    assert {".preflight/nvml.json", ".preflight/netlink.json", ".preflight/dns.json"} <= names
    assert "proc/self" in names  # a link to the recording process, as /proc/self is


# -- a live network namespace ----------------------------------------------------------------------
@pytest.mark.integration
def test_snapshot_of_a_network_namespace_replays_to_the_live_findings(tmp_path: Path) -> None:
    from netns_lab import ENTER, namespace, present, two_rails_in_one_subnet, verdicts

    with namespace("snap", tmp_path) as ns:
        name = ns.name
        two_rails_in_one_subnet(ns)
        ns.nic("docker0", "172.17.0.1/16")
        ns.ipr.route("add", dst="10.98.0.0/16", type="unreachable")
        env = {"MASTER_ADDR": "10.98.0.5", "NCCL_SOCKET_IFNAME": "^ens"}
        config = tmp_path / "site.toml"
        config.write_text('[expect]\npeers = ["10.50.0.9", "10.60.0.1"]\n')
        clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), **env}

        def inside(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-c", ENTER, name, *preflight_command(), *args],
                capture_output=True, text=True, timeout=120, env=clean, cwd=tmp_path,
            )

        archive = tmp_path / "netns.tar.gz"
        recorded = inside("snapshot", str(archive), "--config", str(config))
        assert recorded.returncode == 0, recorded.stderr
        live = inside("node", "--select", "NET", "--format", "json", "--config", str(config))
    replay = subprocess.run(
        [*preflight_command(), "node", "--root", str(archive), "--select", "NET", "--format", "json", "--config", str(config)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )
    live_report, replayed = json.loads(live.stdout), json.loads(replay.stdout)
    assert {("NET001", "docker0"), ("NET004", "10.98.0.5"), ("NET004", "10.60.0.1"), ("NET005", "ens2f0")} <= present(live_report)
    assert verdicts(replayed) == verdicts(live_report)
    assert replayed["findings"] == live_report["findings"]  # evidence, reasons, fixes
    assert [(p["name"], p["status"], p["error"]) for p in replayed["probes"]] == [(p["name"], p["status"], p["error"]) for p in live_report["probes"]]
    assert replayed["facts"] == live_report["facts"]  # route origins say "netlink" on both sides


# -- the recording layer on hand-made roots ---------------------------------------------------------
def _recorded_root(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """The direct report of ``root``, the report of its snapshot, and the snapshot."""
    archive = tmp_path / "snap.tar.gz"
    take_snapshot(SnapshotArgs(output=str(archive), root=str(root)))
    return node_report(root, capsys), node_report(archive, capsys), archive


def test_read_errors_listing_errors_and_stat_errors_replay_by_errno(node_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(node_copy, "/.preflight/read-errors.json", json.dumps({
        "format": "preflight-read-errors/1",
        "errors": {"/proc/self/limits": "EACCES", "/etc/nccl.conf": "EIO", "/dev/kmsg": "EPERM"},
        "listdir": {"/sys/class/infiniband_verbs": "EACCES"},
        "stat": {"/dev/gdrdrv": "EACCES"},
    }))
    direct, replayed, archive = _recorded_root(node_copy, tmp_path, capsys)
    assert normalised(replayed) == normalised(direct)
    text = json.dumps(direct)
    assert "permission denied (EACCES)" in text and "input/output error (EIO)" in text
    with tarfile.open(archive) as tar:
        errors = json.loads(tar.extractfile(".preflight/read-errors.json").read())  # type: ignore[union-attr]
    assert errors["errors"]["/proc/self/limits"] == "EACCES" and errors["errors"]["/dev/kmsg"] == "EPERM"
    assert errors["listdir"] == {"/sys/class/infiniband_verbs": "EACCES"} and errors["stat"] == {"/dev/gdrdrv": "EACCES"}


def test_files_too_large_and_binary_files_replay_the_same_refusal(node_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(node_copy, "/etc/nccl.conf", b"NCCL_IB_HCA=mlx5\n" + b"#" * (2 * 1024 * 1024))  # over the 1 MiB read bound
    write(node_copy, "/proc/sys/kernel/osrelease", b"\xff\xfe garbage")
    direct, replayed, archive = _recorded_root(node_copy, tmp_path, capsys)
    assert "larger than 1048576 bytes" in json.dumps(direct)
    assert normalised(replayed) == normalised(direct)
    assert archive.stat().st_size < 100_000  # only the bound plus one byte is kept


def test_symlink_loops_and_dangling_links_replay(node_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nccl_conf = node_copy / "etc/nccl.conf"
    nccl_conf.unlink(missing_ok=True)
    nccl_conf.symlink_to("nccl.conf")  # a link to itself
    version = node_copy / "sys/module/nvidia/version"
    version.unlink()
    version.symlink_to("/nowhere/version")  # dangling: absent, as on a node
    direct, replayed, _ = _recorded_root(node_copy, tmp_path, capsys)
    assert "symbolic links (ELOOP)" in json.dumps(direct)
    assert normalised(replayed) == normalised(direct)


def test_kernel_log_records_keep_their_continuation_lines(node_copy: Path) -> None:
    (node_copy / ".preflight" / "kmsg").write_text("6,1,5,-;mlx5_core 0000:1a:00.0: hello\n SUBSYSTEM=pci\n DEVICE=+pci:0000:1a:00.0\n4,2,9,-;second\n")
    records = NodeFS(str(node_copy)).read_kernel_log()
    assert records == ["6,1,5,-;mlx5_core 0000:1a:00.0: hello\n SUBSYSTEM=pci\n DEVICE=+pci:0000:1a:00.0", "4,2,9,-;second"]


def test_kernel_log_keeps_the_newest_records_it_is_asked_for(node_copy: Path) -> None:
    """Beyond the byte budget the oldest records go (the last job's Xid matters most), and with
    ``keep`` routine records never use the budget at all."""
    noise = "".join(f"6,{n},{n}000,-;mlx5_core 0000:1a:00.0: routine message number {n}\n" for n in range(2000))
    (node_copy / ".preflight" / "kmsg").write_text(
        "4,0,1,-;NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=python, GPU has fallen off the bus.\n" + noise
        + "4,9999,99999999,-;NVRM: Xid (PCI:0000:5d:00): 94, pid=2, name=python, Contained: CE User Channel (0x9).\n"
    )
    fs = NodeFS(str(node_copy))
    tail = fs.read_kernel_log(max_bytes=4096)
    assert tail is not None and tail[-1].startswith("4,9999,") and "GPU has fallen off" not in "".join(tail)
    assert all(record[:1].isdigit() for record in tail)  # the record cut by the window is dropped whole
    kept = fs.read_kernel_log(max_bytes=1 << 20, keep=("Xid",))
    assert kept is not None and [record.split(";")[0] for record in kept] == ["4,0,1,-", "4,9999,99999999,-"]


class _HangingNvml:
    """Answers the count, then blocks forever like a wedged driver."""

    def call(self, function: str, index: int | None = None, *args: object) -> Any:
        if function == "nvmlDeviceGetCount":
            return 2
        if index == 1:
            import threading

            threading.Event().wait()
        raise NvmlError("NVML_ERROR_NOT_SUPPORTED", "not on this board")


def test_nvml_answers_errors_and_hangs_are_recorded(tmp_path: Path) -> None:
    fs = RecordingFS(str(EXAMPLE_ROOT))
    sources = Sources.for_fs(fs)
    recorders = record(fs, _HangingNvml(), sources.netlink, sources.dns)
    assert recorders.nvml is not None
    assert recorders.nvml.call("nvmlDeviceGetCount") == 2
    with pytest.raises(NvmlError):
        recorders.nvml.call("nvmlDeviceGetNvLinkState", 0, 3)
    import threading

    threading.Thread(target=lambda: recorders.nvml.call("nvmlDeviceGetName", 1), daemon=True).start()  # type: ignore[union-attr]
    deadline = time.monotonic() + 60  # a hang guard: the call is recorded as soon as it starts
    while not recorders.nvml.document()["calls"].get("nvmlDeviceGetName") and time.monotonic() < deadline:
        time.sleep(0.01)
    document = recorders.nvml.document()
    assert document["calls"]["nvmlDeviceGetCount"] == {"result": 2}
    assert document["calls"]["nvmlDeviceGetNvLinkState"] == {"0/3": {"error": "NVML_ERROR_NOT_SUPPORTED", "detail": "not on this board"}}
    assert document["calls"]["nvmlDeviceGetName"] == {"1": {"hang": True}}
    replay = ReplayNvml(document)
    with pytest.raises(NvmlError) as raised:
        replay.call("nvmlDeviceGetNvLinkState", 0, 3)
    assert str(raised.value) == "NVML_ERROR_NOT_SUPPORTED: not on this board"


def test_dns_failures_are_recorded_as_the_same_errors(tmp_path: Path) -> None:
    fs = RecordingFS(str(FIXTURES / "roce-v1v2"))
    sources = Sources.for_fs(fs)  # no dns.json: every DNS question fails with "no recording"
    recorders = record(fs, sources.nvml, sources.netlink, sources.dns)
    assert recorders.dns is not None
    errors = []
    for ask in (lambda: recorders.dns.check_nameservers("x"), lambda: recorders.dns.resolve_many([("a", "A"), ("b", "AAAA")])):  # type: ignore[union-attr]
        with pytest.raises(SourceError) as raised:
            ask()
        errors.append(str(raised.value))
    replay = ReplayDns(recorders.dns.document())
    for ask, expected in zip((lambda: replay.check_nameservers("x"), lambda: replay.resolve_many([("a", "A")])), errors):
        with pytest.raises(SourceError) as raised:
            ask()
        assert str(raised.value) == expected


def test_nameserver_health_round_trips(tmp_path: Path) -> None:
    class Servers:
        def nameservers(self) -> list[str]:
            return ["10.0.0.2", "10.0.0.3"]

        def check_nameservers(self, name: str) -> list[NameserverCheck]:
            return [NameserverCheck("10.0.0.2", "NOERROR", 0.004), NameserverCheck("10.0.0.3", error="TIMEOUT", detail="no answer within 2 s")]

    fs = RecordingFS(str(EXAMPLE_ROOT))
    sources = Sources.for_fs(fs)
    recorders = record(fs, sources.nvml, sources.netlink, Servers())  # type: ignore[arg-type]
    live = recorders.dns.check_nameservers("gpu017")  # type: ignore[union-attr]
    assert ReplayDns(recorders.dns.document()).check_nameservers("gpu017") == live  # type: ignore[union-attr]


def test_every_filesystem_question_is_recorded() -> None:
    """A method added to NodeFS must be recorded (or derive from recorded ones): otherwise
    snapshots would silently replay its answers wrong. Add it to RecordingFS and the format."""
    public = {name for name in dir(NodeFS) if not name.startswith("_") and callable(getattr(NodeFS, name))}
    assert public <= RECORDED_METHODS | DERIVED_METHODS, sorted(public - RECORDED_METHODS - DERIVED_METHODS)


def test_every_netlink_nvml_and_dns_question_is_recorded() -> None:
    """Likewise for the other sources: a question the recorder lacks would fail the run."""
    from preflight.sources.dns import LiveDns
    from preflight.sources.netlink import LiveNetlink
    from preflight.sources.nvml import LiveNvml
    from preflight.sources.recording import RecordingDns, RecordingNetlink, RecordingNvml

    for live, recording in ((LiveNetlink, RecordingNetlink), (LiveDns, RecordingDns), (LiveNvml, RecordingNvml)):
        questions = {name for name in dir(live) if not name.startswith("_") and callable(getattr(live, name))}
        assert questions <= set(dir(recording)), (recording.__name__, sorted(questions - set(dir(recording))))


def test_unrecorded_questions_are_named_in_the_manifest(tmp_path: Path) -> None:
    class NewView(RecordingFS):
        pass

    NodeFS.newly_added = lambda self: 42  # type: ignore[attr-defined]
    try:
        fs = NewView(str(EXAMPLE_ROOT))
        assert fs.newly_added() == 42  # type: ignore[attr-defined]
        assert fs.recording.unrecorded == {"newly_added"}
    finally:
        del NodeFS.newly_added  # type: ignore[attr-defined]


def test_the_environment_is_recorded_by_allow_list(node_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Only the values checks read are kept, and without URL credentials; every other variable
    keeps its name only. A list of suspicious names let https_proxy, DATABASE_URL and friends
    through before."""
    environ = (node_copy / "proc/self/environ").read_bytes()
    leaks = {
        b"AWS_SECRET_ACCESS_KEY": b"abc123", b"HF_TOKEN": b"hf_xyz", b"https_proxy": b"http://alice:pw1@proxy:3128",
        b"DATABASE_URL": b"postgres://svc:pw2@db/prod", b"MLFLOW_TRACKING_URI": b"https://tok3@mlflow.example",
        b"PIP_INDEX_URL": b"https://u:pw4@pypi.example/simple", b"GITHUB_PAT": b"ghp_pw5", b"SENTRY_DSN": b"https://pw6@sentry.example/1",
    }
    extra = b"".join(name + b"=" + value + b"\0" for name, value in leaks.items())
    extra += b"NCCL_DEBUG=INFO\0TORCHELASTIC_RDZV_ENDPOINT=etcd://root:pw7@etcd:2379\0"
    (node_copy / "proc/self/environ").write_bytes(environ + extra)
    archive = tmp_path / "snap.tar.gz"
    result = take_snapshot(SnapshotArgs(output=str(archive), root=str(node_copy)))
    with tarfile.open(archive) as tar:
        recorded = tar.extractfile("proc/self/environ").read()  # type: ignore[union-attr]
    for secret in (b"abc123", b"hf_xyz", b"pw1", b"pw2", b"tok3", b"pw4", b"pw5", b"pw6", b"pw7"):
        assert secret not in recorded, secret
    for name in leaks:
        assert name + b"=<redacted>" in recorded
    assert b"NCCL_DEBUG=INFO" in recorded and b"TORCHELASTIC_RDZV_ENDPOINT=etcd://<redacted>@etcd:2379" in recorded
    assert set(result.snapshot.manifest["redacted_environment"]) >= {name.decode() for name in leaks}
    # the same verdicts; the recorded environment itself lacks the credentials on purpose
    assert node_report(archive, capsys)["findings"] == node_report(node_copy, capsys)["findings"]


def test_a_scrub_key_without_scrubbing_is_an_error(run_cli: Runner, tmp_path: Path) -> None:
    result = run_cli("snapshot", "--root", str(EXAMPLE_ROOT), "--scrub-key", "k", str(tmp_path / "x.tar.gz"))
    assert result.returncode == 3 and "without --scrub" in result.stderr and not (tmp_path / "x.tar.gz").exists()


def test_the_scrub_key_never_enters_the_snapshot(run_cli: Runner, tmp_path: Path) -> None:
    """Given through the environment, the key is in the recording process's /proc/self/environ."""
    archive = tmp_path / "live.tar.gz"
    result = run_cli("snapshot", str(archive), "--scrub", "all", env={"PREFLIGHT_SCRUB_KEY": "supersecret-4711"}, timeout=120)
    assert result.returncode == 0, result.stderr
    with tarfile.open(archive) as tar:
        contents = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
    assert not any(b"supersecret-4711" in data for data in contents.values())
    manifest = json.loads(contents[MANIFEST])
    assert "PREFLIGHT_SCRUB_KEY" in manifest["redacted_environment"] and manifest["scrub"]["key"] == "given"


# -- size (its time against the 1 s target is bench/snapshot.py's figure) ------------------------
def test_snapshot_of_the_8_gpu_example_is_small(tmp_path: Path) -> None:
    archive = tmp_path / "node.tar.gz"
    result = take_snapshot(SnapshotArgs(output=str(archive), root=str(EXAMPLE_ROOT)))
    assert archive.stat().st_size == result.size <= 1_000_000


def test_unwritable_destination_is_a_clear_error(run_cli: Runner, tmp_path: Path) -> None:
    directory = tmp_path / "named-like-an-archive.tar.gz"
    directory.mkdir()
    cases = {
        str(tmp_path / "missing" / "out.tar.gz"): "no such file or directory (ENOENT)",
        str(directory): "is a directory (EISDIR)",
        "/proc/version/out.tar.gz": "not a directory (ENOTDIR)",
    }
    for target, reason in cases.items():
        result = run_cli("snapshot", target, "--root", str(EXAMPLE_ROOT))
        assert result.returncode == 3, result.stderr
        assert f"preflight: error: cannot write {target}: {reason}" in result.stderr
        assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == [directory] and list(directory.iterdir()) == []  # no partial file left behind


def test_full_disk_leaves_no_partial_snapshot(run_cli: Runner, tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(small)], capture_output=True, timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        result = run_cli("snapshot", str(small / "node.tar.gz"), "--root", str(EXAMPLE_ROOT))
        assert result.returncode == 3
        assert f"cannot write {small / 'node.tar.gz'}: no space left on device (ENOSPC)" in result.stderr
        assert "Traceback" not in result.stderr
        assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], capture_output=True, timeout=30)


def test_bad_snapshot_options(run_cli: Runner, tmp_path: Path) -> None:
    for args, message in (
        (["--scrub", "passwords"], "--scrub 'passwords': choose from"),
        (["--profile", "quick"], "--profile 'quick'"),
        (["--root", str(tmp_path / "nowhere")], "no such directory"),
        (["--config", str(tmp_path / "none.toml")], "no such file"),
        (["--scrub", "all", "--scrub-key", ""], "--scrub-key must not be empty"),
    ):
        result = run_cli("snapshot", str(tmp_path / "out.tar.gz"), *args, env={"PREFLIGHT_SCRUB_KEY": ""} if "--scrub-key" in args else None)
        assert result.returncode == 3, (args, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out.tar.gz").exists()


def test_unreadable_site_config_path_is_reported_not_recorded(tmp_path: Path) -> None:
    from preflight.config import ConfigError

    with pytest.raises(ConfigError, match="is a directory"):
        take_snapshot(SnapshotArgs(output=str(tmp_path / "out.tar.gz"), root=str(EXAMPLE_ROOT), config=str(tmp_path)))
    assert not (tmp_path / "out.tar.gz").exists()


def test_a_process_that_exits_while_the_snapshot_is_taken_is_left_out(tmp_path: Path) -> None:
    """/proc is listed, then a process exits before its files are read: the recording drops
    its entry, so the replay lists no process whose files are "not captured" (an unknown the
    live node, where the process is simply gone, never shows)."""
    for pid in ("1", "4242"):
        (tmp_path / "proc" / pid).mkdir(parents=True)
        (tmp_path / "proc" / pid / "comm").write_text("python\n")
    fs = RecordingFS(str(tmp_path))
    assert sorted(fs.listdir("/proc") or []) == ["1", "4242"]
    assert fs.read("/proc/1/comm") == "python\n"
    (tmp_path / "proc" / "4242" / "comm").unlink()
    (tmp_path / "proc" / "4242").rmdir()  # the process exits
    with pytest.raises(SourceError):  # a recorded root (not "/") says so; a live node answers absent
        fs.read("/proc/4242/comm")
    recording = fs.recording
    assert "/proc/4242" not in recording.dirs and not any(path.startswith("/proc/4242/") for path in recording.files)
    assert "/proc/1" in recording.dirs and recording.files["/proc/1/comm"] == b"python\n"
