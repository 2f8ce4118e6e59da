"""``preflight slurm``: the ``[slurm]`` config section, job scoping, opt-out, drain policy, reasons,
``scontrol show node`` parsing, and the commands end to end on recorded roots with a stand-in
``scontrol`` (a script that records its arguments). Real Slurm: ``test_slurm_integration.py``."""

from __future__ import annotations

import json
import shutil
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import jsonschema
import pytest

from conftest import EXAMPLE_ROOT, REPO, Runner, drain_datagrams
from preflight.config import CPU_JOB_IGNORE, ConfigError, SlurmSettings, parse_config, salvage_slurm_settings
from preflight.model import Evidence, Finding, Severity, Status
from preflight.probes.job import parse_gpu_indices
from preflight.slurm import (
    JobScope,
    drain_reason,
    gpu_indices,
    job_scope,
    judge_findings,
    opt_out_source,
    other_jobs_on_node,
    parse_show_node,
    prolog_timeout_problem,
    run_command,
    sanitise_reason,
    send_syslog,
    slurm_conf_lines,
    view_scope,
    wrapper_scripts,
    write_atomically,
)
from preflight.sources import NodeFS

REPORT_SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "preflight/schemas/report-v1.schema.json").read_text())
SHOW_NODE = (
    "NodeName=gpu017 Arch=x86_64 CoresPerSocket=56  CPUAlloc=0 CPUEfctv=224 CPUTot=224 CPULoad=0.31 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:h100:8 NodeAddr=gpu017 NodeHostName=gpu017 "
    "Version=22.05.8 OS=Linux 5.15.0-105-generic #115-Ubuntu SMP  RealMemory=2000000 AllocMem=0 "
    "State={state} ThreadsPerCore=2 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=gpu  "
    "BootTime=2024-05-02T08:11:09 SlurmdStartTime=2024-05-02T08:12:30 CfgTRES=cpu=224,mem=2000000M "
    "AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s{reason}"
)


def show_node(state: str, reason: str = "") -> str:
    return SHOW_NODE.format(state=state, reason=f" Reason={reason} [root@2024-05-02T09:00:01]" if reason else "")


def finding(ref_id: str, status: Status = Status.PRESENT, severity: Severity = Severity.ERROR, subject: str = "node") -> Finding:
    return Finding(ref_id, "some-symbol", "title", status, severity, subject, (Evidence("/x", "y"),))


def config(text: str) -> SlurmSettings:
    return parse_config(text, "/etc/preflight/preflight.toml", "gpu017").slurm


# ---- [slurm] configuration -------------------------------------------------------------------


def test_slurm_defaults_when_the_section_is_absent() -> None:
    settings = config("")
    assert settings == SlurmSettings()
    assert settings.drain_severity is Severity.ERROR and not settings.fail_closed and settings.drain
    assert settings.cpu_job_ignore == CPU_JOB_IGNORE and settings.opt_out == "preflight=off"


def test_slurm_section_is_parsed() -> None:
    settings = config(
        """
[slurm]
timeout = 6.5
healthcheck_timeout = 45
scontrol_timeout = 2
drain_severity = "warning"
fail_closed = true
drain = false
scontrol = "/opt/slurm/bin/scontrol"
node_name = "gpu017"
opt_out = "healthchecks_prolog=off"
opt_out_variables = ["SLURM_JOB_EXTRA"]
cpu_job_ignore = []
epilog_profile = "full"
last_result = "/run/preflight/{mode}.json"
syslog = false
syslog_socket = "/run/systemd/journal/dev-log"
"""
    )
    assert settings == SlurmSettings(
        timeout_s=6.5, healthcheck_timeout_s=45.0, scontrol_timeout_s=2.0, drain_severity=Severity.WARNING,
        fail_closed=True, drain=False, scontrol="/opt/slurm/bin/scontrol", node_name="gpu017",
        opt_out="healthchecks_prolog=off", opt_out_variables=("SLURM_JOB_EXTRA",), cpu_job_ignore=(),
        epilog_profile="full", last_result="/run/preflight/{mode}.json", syslog=False,
        syslog_socket="/run/systemd/journal/dev-log",
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("timeout = 0", "slurm.timeout: 0 must be a positive number"),
        ("timeout = \"5s\"", "slurm.timeout"),
        ("drain_severity = \"fatal\"", "slurm.drain_severity: 'fatal' must be one of"),
        ("fail_closed = \"yes\"", "slurm.fail_closed: 'yes' must be true or false"),
        ("drain = 1", "slurm.drain: 1 must be true or false"),
        ("scontrol = \"bin/scontrol\"", "slurm.scontrol: 'bin/scontrol' must be a program name or an absolute path"),
        ("node_name = \"gpu 17\"", "slurm.node_name"),
        ("opt_out_variables = [\"SLURM-JOB\"]", "is not an environment variable name"),
        ("cpu_job_ignore = \"GPU\"", "slurm.cpu_job_ignore: 'GPU' must be a list of strings"),
        ("epilog_profile = \"quick\"", "slurm.epilog_profile"),
        ("last_result = \"results.json\"", "slurm.last_result: 'results.json' must be an absolute path"),
        ("last_result = \"/var/lib/preflight/{node}.json\"", "no placeholder other than {mode}"),
        ("syslog_socket = \"dev/log\"", "slurm.syslog_socket"),
        ("drain_timeout = 3", "slurm.drain_timeout: unknown key"),
        ("timeout = 5\nscontrol_timeout = 3", "slurm.timeout: 5 must be more than twice slurm.scontrol_timeout (3)"),
        ("healthcheck_timeout = 65535", "slurm.healthcheck_timeout: 65535 must be below 65535 (the longest HealthCheckTimeout"),
    ],
)
def test_slurm_section_rejects_bad_values_naming_line_and_key(body: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        config(f"[run]\ntimeout = 10.0\n\n[slurm]\n{body}\n")
    assert message in str(error.value)
    assert str(error.value).startswith("/etc/preflight/preflight.toml:")


def test_salvaged_slurm_keys_say_where_a_broken_config_leaves_its_trace() -> None:
    """A config that fails validation still names the last-result file and syslog socket."""
    salvaged = salvage_slurm_settings(
        '[run]\nprobe_timout = 2\n[slurm]\nlast_result = "/srv/pf/{mode}.json"\ndrain_severity = "fatal"\n'
        'syslog_socket = "/run/log"\ntimeout = "soon"\n'
    )
    assert salvaged == SlurmSettings(last_result="/srv/pf/{mode}.json", syslog_socket="/run/log")
    assert salvage_slurm_settings("[slurm\nlast_result = 3") == SlurmSettings()  # no [slurm] table: the defaults
    # Not TOML at all: the [slurm] table's lines are read one by one, a broken one left out.
    broken = 'garbage = = [\n[slurm]\nlast_result = "/srv/pf/{mode}.json"\ntimeout = = 3\nsyslog = false\n[run]\nsyslog = true\n'
    assert salvage_slurm_settings(broken) == SlurmSettings(last_result="/srv/pf/{mode}.json", syslog=False)
    assert salvage_slurm_settings("slurm = 3\n") == SlurmSettings()


def test_slurm_section_must_be_a_table() -> None:
    with pytest.raises(ConfigError, match="slurm: must be a table"):
        config("slurm = 3\n")


# ---- job scope and opt-out -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0", (0,)), ("3,1", (1, 3)), ("0-3", (0, 1, 2, 3)), ("0,2-3", (0, 2, 3)), ("gpu0", None), ("1,", None), ("3-1", None), ("", None)],
)
def test_parse_gpu_indices(text: str, expected: tuple[int, ...] | None) -> None:
    assert parse_gpu_indices(text) == expected


def test_job_scope_gpu_job_cpu_job_and_healthcheck() -> None:
    settings = SlurmSettings()
    gpu_job = job_scope("prolog", {"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "1,3", "CUDA_VISIBLE_DEVICES": "0,1"}, settings)
    assert gpu_job == JobScope("42", (1, 3), "1,3", "", (), "")
    cpu_job = job_scope("epilog", {"SLURM_JOB_ID": "43"}, settings)
    assert cpu_job.gpus is None and cpu_job.ignore == CPU_JOB_IGNORE
    assert job_scope("prolog", {"SLURM_JOB_ID": "44", "SLURM_JOB_GPUS": ""}, settings).ignore == CPU_JOB_IGNORE
    garbled = job_scope("prolog", {"SLURM_JOB_ID": "45", "SLURM_JOB_GPUS": "(null)"}, settings)
    assert garbled.gpus is None and garbled.ignore == ()  # judge every GPU rather than guess
    assert job_scope("healthcheck", {"SLURM_JOB_ID": "46", "SLURM_JOB_COMMENT": "preflight=off"}, settings) == JobScope()


def test_job_scope_before_slurm_21_08_takes_the_gpus_from_cuda_visible_devices() -> None:
    """Slurm 19.05 to 21.07 gives the prolog, and every release before 21.08 the epilog, only
    CUDA_VISIBLE_DEVICES (the gres indices, or gres.conf's unique IDs), no SLURM_JOB_GPUS: such a
    job is a GPU job, not a CPU job whose GPU findings are skipped (SchedMD commit f6e8d16)."""
    settings = SlurmSettings()
    old = job_scope("prolog", {"SLURM_JOB_ID": "42", "CUDA_VISIBLE_DEVICES": "1,3"}, settings)
    assert (old.gpus, old.ignore, old.gpus_from) == ((1, 3), (), "CUDA_VISIBLE_DEVICES")
    assert old.to_json()["gpus_from"] == "CUDA_VISIBLE_DEVICES"
    uuids = job_scope("epilog", {"SLURM_JOB_ID": "42", "CUDA_VISIBLE_DEVICES": "GPU-5f0c2a3e-1b2c"}, settings)
    assert (uuids.gpus, uuids.ignore) == (None, ())  # unparsable: every GPU is judged
    assert job_scope("prolog", {"SLURM_JOB_ID": "43", "CUDA_VISIBLE_DEVICES": ""}, settings).ignore == CPU_JOB_IGNORE


def test_single_node_job_ignore_skips_only_for_a_gpu_job_of_one_node() -> None:
    """Off by default; when a site lists references, a GPU job whose node list names one host
    skips them, a job of several hosts, an unparsable or missing node list does not."""
    gpu = {"SLURM_JOB_ID": "47", "SLURM_JOB_GPUS": "0,1"}
    assert job_scope("prolog", {**gpu, "SLURM_JOB_NODELIST": "gpu017"}, SlurmSettings()).ignore == ()
    settings = SlurmSettings(single_node_job_ignore=("IB", "ROCE", "GDR001"))
    for nodelist in ("gpu017", "gpu[017]", " gpu017 "):
        assert job_scope("prolog", {**gpu, "SLURM_JOB_NODELIST": nodelist}, settings).ignore == ("IB", "ROCE", "GDR001")
    for environ in ({**gpu, "SLURM_JOB_NODELIST": "gpu[017-018]"}, {**gpu, "SLURM_JOB_NODELIST": "gpu[017-"}, gpu):
        assert job_scope("epilog", environ, settings).ignore == ()
    # A CPU job keeps its own list; the health check judges the whole node.
    assert job_scope("prolog", {"SLURM_JOB_ID": "48", "SLURM_JOB_NODELIST": "cpu1"}, settings).ignore == CPU_JOB_IGNORE
    assert job_scope("healthcheck", {**gpu, "SLURM_JOB_NODELIST": "gpu017"}, settings).ignore == ()
    assert config('[slurm]\nsingle_node_job_ignore = ["IB", "EFA"]\n').single_node_job_ignore == ("IB", "EFA")


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"SLURM_JOB_EXTRA": "preflight=off"}, "SLURM_JOB_EXTRA=preflight=off"),
        ({"SLURM_JOB_EXTRA": "team=a,preflight=off"}, "SLURM_JOB_EXTRA=preflight=off"),
        ({"SLURM_JOB_COMMENT": "benchmark run; PREFLIGHT=OFF"}, "SLURM_JOB_COMMENT=preflight=off"),
        ({"SLURM_JOB_COMMENT": "preflight=offline"}, ""),
        ({"SLURM_JOB_COMMENT": "no-preflight=off"}, ""),
        ({"SLURM_JOB_NAME": "preflight=off"}, ""),
        ({}, ""),
    ],
)
def test_opt_out_token_must_be_a_whole_item(environ: dict[str, str], expected: str) -> None:
    assert opt_out_source(environ, SlurmSettings()) == expected


def test_opt_out_can_be_renamed_restricted_or_switched_off() -> None:
    environ = {"SLURM_JOB_EXTRA": "healthchecks_prolog=off", "SLURM_JOB_COMMENT": "preflight=off"}
    renamed = SlurmSettings(opt_out="healthchecks_prolog=off")
    assert opt_out_source(environ, renamed) == "SLURM_JOB_EXTRA=healthchecks_prolog=off"
    assert opt_out_source(environ, SlurmSettings(opt_out_variables=("SLURM_JOB_EXTRA",))) == ""
    assert opt_out_source(environ, SlurmSettings(opt_out="")) == ""


# ---- drain policy and reasons ----------------------------------------------------------------


def test_present_at_or_above_drain_severity_drains_and_unknown_does_not() -> None:
    findings = [
        finding("MEM001"), finding("TOPO005", severity=Severity.WARNING), finding("GPU001", Status.UNKNOWN, Severity.CRITICAL),
        finding("DNS001", Status.ABSENT), finding("IB009", Status.NOT_APPLICABLE),
    ]
    verdict = judge_findings(findings, SlurmSettings(), JobScope())
    assert [f.reference_id for f in verdict.drain] == ["MEM001"] and [f.reference_id for f in verdict.undecided] == ["GPU001"]
    assert verdict.outcome == "drain"
    warning_site = judge_findings(findings, SlurmSettings(drain_severity=Severity.WARNING), JobScope())
    assert [f.reference_id for f in warning_site.drain] == ["MEM001", "TOPO005"]
    critical_site = judge_findings(findings, SlurmSettings(drain_severity=Severity.CRITICAL), JobScope())
    assert critical_site.drain == () and critical_site.outcome == "undecided"
    fail_closed = judge_findings(findings, SlurmSettings(fail_closed=True), JobScope())
    assert [f.reference_id for f in fail_closed.drain] == ["MEM001", "GPU001"]


def test_only_unknown_or_nothing_leaves_the_node_running() -> None:
    assert judge_findings([finding("GPU001", Status.UNKNOWN)], SlurmSettings(), JobScope()).outcome == "undecided"
    assert judge_findings([finding("MEM001", Status.ABSENT)], SlurmSettings(), JobScope()).outcome == "clean"
    assert judge_findings([], SlurmSettings(), JobScope()).outcome == "clean"


def test_findings_about_gpus_outside_the_job_do_not_drain() -> None:
    findings = [finding("GPU002", subject="GPU5"), finding("GPU002", subject="GPU1"), finding("MEM001", subject="slurmd")]
    scoped = judge_findings(findings, SlurmSettings(), JobScope("7", (0, 1), "0,1"))
    assert [(f.reference_id, f.subject) for f in scoped.drain] == [("GPU002", "GPU1"), ("MEM001", "slurmd")]
    assert [f.subject for f in scoped.out_of_scope] == ["GPU5"]
    outside_only = judge_findings([findings[0]], SlurmSettings(), JobScope("7", (0, 1), "0,1"))
    assert outside_only.outcome == "clean" and len(outside_only.out_of_scope) == 1
    whole_node = judge_findings(findings, SlurmSettings(), JobScope())
    assert len(whole_node.drain) == 3


def test_gpus_named_by_pci_address_are_scoped_through_nvml_indices() -> None:
    """PCIe, topology and Xid findings name a GPU by its address; the report's gpus facts say
    which NVML index that is. Without them nothing says whose GPU it is: it counts for the job."""
    facts = {"gpus": {"devices": [{"index": 0, "bus_id": "0000:18:00.0"}, {"index": 3, "bus_id": "0000:5d:00.0"},
                                  {"index": "x", "bus_id": "0000:9a:00.0"}, "garbage", {"index": 7, "bus_id": 12}]}}
    indices = gpu_indices(facts)
    assert indices == {(0, 0x18, 0): 0, (0, 0x5D, 0): 3}
    findings = [finding("PCI002", subject="GPU 0000:18:00.0"), finding("GPU002", subject="GPU 0000:5d:00"),
                finding("TOPO005", subject="GPU 0000:9a:00.0")]
    scoped = judge_findings(findings, SlurmSettings(), JobScope("7", (0, 1), "0,1"), indices)
    # GPU 3's Xid is not this job's; 9a's index is unknown (garbage facts), so it counts.
    assert [f.subject for f in scoped.drain] == ["GPU 0000:18:00.0", "GPU 0000:9a:00.0"]
    assert [f.subject for f in scoped.out_of_scope] == ["GPU 0000:5d:00"]
    assert len(judge_findings(findings, SlurmSettings(), JobScope("7", (0, 1), "0,1"), gpu_indices({})).drain) == 3
    assert gpu_indices({"gpus": None}) == {} and gpu_indices({"gpus": {"devices": "x"}}) == {}


def test_in_the_jobs_cgroup_every_gpu_nvml_names_is_the_jobs() -> None:
    """PrologFlags=RunInJob with ConstrainDevices: the prolog's NVML lists the job's two GPUs as 0
    and 1 while SLURM_JOB_GPUS says 4,5; a finding on NVML's GPU1 is the job's and drains. Outside
    the job's cgroup (or with every GPU visible) the node indices decide as before."""
    scope = JobScope("7", (4, 5), "4,5")
    narrowed = {"job": {"cgroup_job": "job_7"}, "gpus": {"devices": [{"index": 0}, {"index": 1}], "pci_gpus": ["a"] * 8}}
    lost = [finding("GPU001", subject="GPU1")]
    assert len(judge_findings(lost, SlurmSettings(), view_scope(scope, narrowed)).drain) == 1
    assert judge_findings(lost, SlurmSettings(), scope).drain == ()
    for facts in ({**narrowed, "job": {"cgroup_job": ""}}, {**narrowed, "gpus": {"devices": [{"index": i} for i in range(8)], "pci_gpus": ["a"] * 8}}, {}):
        assert view_scope(scope, facts) == scope
    assert view_scope(JobScope("7", None, None), narrowed).gpus is None


def test_with_mig_slurm_job_gpus_numbers_instances_so_every_gpu_finding_counts() -> None:
    """Slurm makes each MIG instance one GPU GRES: on a node of 7+7+7+7+2+2+1+1 instances,
    SLURM_JOB_GPUS=8 is an instance of NVML's GPU1, not GPU8; a finding on GPU1 must not be put
    outside the job (nor one on GPU8's neighbour drain it for the wrong job by chance)."""
    scope = JobScope("5001", (8,), "8")
    mig = {"job": {"cgroup_job": ""}, "gpus": {"devices": [{"index": i, "mig": i < 4} for i in range(8)], "pci_gpus": ["a"] * 8}}
    ecc = [finding("GPU002", subject="GPU1")]
    assert judge_findings(ecc, SlurmSettings(), scope).drain == ()  # read as NVML indices: outside the job
    assert len(judge_findings(ecc, SlurmSettings(), view_scope(scope, mig)).drain) == 1
    whole = {**mig, "gpus": {"devices": [{"index": i, "mig": False} for i in range(8)], "pci_gpus": ["a"] * 8}}
    assert view_scope(scope, whole) == scope


def test_gpu_indices_from_a_real_run_of_the_example_node(example_root: Path) -> None:
    """The facts a prolog's own run reports: the example node's eight GPUs by address."""
    from preflight.run import inspect_node, open_node

    report = inspect_node(open_node(str(example_root), None), profile="prolog", select=("GPU002",))
    indices = gpu_indices(report.facts)
    assert indices[(0, 0x5D, 0)] == 3 and len(indices) == 8


def test_drain_reason_names_ids_worst_first_and_the_job() -> None:
    findings = [finding("MEM001", subject="slurmd"), finding("ROCE003", severity=Severity.CRITICAL, subject="mlx5_0/1"), finding("MEM001", subject="slurm.conf")]
    reason = drain_reason(findings, "prolog", "4242")
    assert reason == "preflight: ROCE003,MEM001 some-symbol on mlx5_0/1 (prolog job 4242)"
    assert drain_reason([finding("GPU001", Status.UNKNOWN)], "healthcheck") == "preflight: GPU001 some-symbol unknown on node (healthcheck)"


def test_drain_reason_is_bounded_and_keeps_ids_first() -> None:
    many = [finding(f"NET{number:03d}", subject="x" * 300) for number in range(1, 40)]
    reason = drain_reason(many, "prolog", "1", limit=120)
    assert len(reason) <= 120 and reason.startswith("preflight: NET001,NET002,")
    assert ",+" in reason and reason.endswith("(prolog job 1)")


def test_reason_is_one_sanitised_line() -> None:
    nasty = Finding("NET001", "interface-name", "t", Status.PRESENT, Severity.ERROR, 'eth0"\n\x1b[31mrm -rf\\ `x`\t')
    reason = drain_reason([nasty], "prolog", "9\n9")
    assert "\n" not in reason and "\x1b" not in reason and '"' not in reason and "\\" not in reason and "`" not in reason
    assert reason.isprintable() and "  " not in reason
    assert sanitise_reason("a" * 500, 50) == "a" * 47 + "..."


# ---- scontrol show node ----------------------------------------------------------------------


def test_parse_show_node_reason_with_spaces_and_owner() -> None:
    state = parse_show_node(show_node("IDLE+DRAIN", "preflight: MEM001,DNS001 memlock-limit-too-low on slurmd (prolog job 7)"))
    assert state is not None
    assert state.state == "IDLE+DRAIN" and state.reason == "preflight: MEM001,DNS001 memlock-limit-too-low on slurmd (prolog job 7)"
    assert state.drained and state.ours and not state.held_by_someone_else


@pytest.mark.parametrize(
    ("state", "reason", "drained", "foreign"),
    [
        ("IDLE", "", False, False),
        ("MIXED+DRAIN", "admin: bad DIMM", True, True),
        ("DOWN*", "Not responding", False, True),
        ("DOWN+DRAIN", "preflight: GPU001 (healthcheck)", True, False),
        ("DOWN", "", False, False),
        ("UNKNOWN*", "", False, False),
    ],
)
def test_node_state_ownership(state: str, reason: str, drained: bool, foreign: bool) -> None:
    parsed = parse_show_node(show_node(state, reason))
    assert parsed is not None and parsed.state == state and parsed.reason == reason
    assert parsed.drained is drained and parsed.held_by_someone_else is foreign


@pytest.mark.parametrize("after", ["", " Comment=rack7 Extra=x", " Topology=default:s1"])
@pytest.mark.parametrize("stamp", [" [root@2024-05-02T09:00:01]", ""])
def test_parse_show_node_reason_stops_at_the_fields_after_it(after: str, stamp: str) -> None:
    """scontrol -o prints Comment=, Extra=, Topology= ... on the reason's line (src/api/node_info.c):
    kept in the reason, a health check never saw its own reason and drained the node again."""
    line = f"NodeName=gpu001 Arch=x86_64 State=IDLE+DRAIN Reason=preflight: GPU001 x (healthcheck){stamp}{after}\n"
    state = parse_show_node(line)
    assert state is not None and state.reason == "preflight: GPU001 x (healthcheck)"


@pytest.mark.parametrize("text", ["", "Node gpu099 not found", "slurm_load_node error: Unable to contact slurm controller", "NodeName=x Arch=x86_64"])
def test_parse_show_node_without_a_state_is_none(text: str) -> None:
    assert parse_show_node(text) is None


def test_null_reason_is_no_reason() -> None:
    parsed = parse_show_node(show_node("IDLE").replace("ExtSensorsTemp=n/s", "ExtSensorsTemp=n/s Reason=(null)"))
    assert parsed is not None and parsed.reason == ""


# ---- the boundary: commands, syslog, atomic writes --------------------------------------------


def test_run_command_is_bounded_and_reports_failures(tmp_path: Path) -> None:
    # "timeout" is reported only when the 0.5 s limit cut the 30 s sleep short.
    slow = run_command([sys.executable, "-c", "import time; time.sleep(30)"], 0.5)
    assert slow.status == "timeout"
    assert run_command([sys.executable, "-c", "import sys; print('no'); sys.exit(1)"], 10).status == "failed"
    assert run_command([str(tmp_path / "missing")], 10).status == "failed"
    assert run_command(["true"], 0).status == "not-run"


def test_syslog_line_reaches_the_socket_and_a_missing_socket_is_no_error(tmp_path: Path) -> None:
    path = tmp_path / "log.socket"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(str(path))
        send_syslog(str(path), 27, "preflight: MEM001 (prolog job 1)")
        line = server.recv(4096).decode()
    assert line.startswith("<27>preflight[") and line.endswith("]: preflight: MEM001 (prolog job 1)")
    send_syslog(str(tmp_path / "absent"), 27, "nobody listens")  # returns, raises nothing


def test_syslog_never_blocks_on_a_full_socket(tmp_path: Path) -> None:
    path = tmp_path / "full.socket"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(str(path))
        def flood() -> None:
            for _ in range(2000):  # nobody reads: the queue fills, sends must fail fast instead of waiting
                send_syslog(str(path), 27, "x" * 1000)

        # A send that waited would wait forever: the thread's 60 s join is only a hang guard.
        sender = threading.Thread(target=flood, daemon=True)
        sender.start()
        sender.join(60)
        assert not sender.is_alive(), "send_syslog waited on a full socket"


def test_write_atomically_replaces_whole_files(tmp_path: Path) -> None:
    target = tmp_path / "state" / "last.json"
    assert write_atomically(str(target), "one\n") == ""
    assert write_atomically(str(target), "two\n") == ""
    assert target.read_text() == "two\n" and [p.name for p in target.parent.iterdir()] == ["last.json"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o600  # root's alone: it names the previous job's user and nodes
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert "last.json" in write_atomically(str(blocked / "last.json"), "x")


def test_slurm_conf_lines_fit_the_budget() -> None:
    text = slurm_conf_lines(SlurmSettings(timeout_s=6.0), "/etc/slurm", 600)
    lines = text.splitlines()
    for expected in ("Prolog=/etc/slurm/preflight-prolog", "Epilog=/etc/slurm/preflight-epilog", "PrologFlags=Alloc",
                     "PrologEpilogTimeout=8", "HealthCheckProgram=/etc/slurm/preflight-healthcheck", "HealthCheckInterval=600",
                     "#SchedulerParameters=nohold_on_prolog_fail"):
        assert expected in lines
    # only slurm.conf syntax: comments and Key=value lines
    assert all(line == "" or line.startswith("#") or line.split("=", 1)[0].isalpha() for line in lines)
    wrappers = wrapper_scripts("/usr/local/bin/preflight", "/etc/slurm", "/etc/preflight/site 2.toml")
    assert list(wrappers) == [f"/etc/slurm/preflight-{mode}" for mode in ("prolog", "epilog", "healthcheck")]
    assert wrappers["/etc/slurm/preflight-epilog"].startswith("#!/bin/sh\n")
    assert "exec /usr/local/bin/preflight slurm epilog --config '/etc/preflight/site 2.toml'\n" in wrappers["/etc/slurm/preflight-epilog"]


@pytest.mark.parametrize(
    ("timeout", "message_timeout", "problem"),
    [
        (8.0, 10, ""), (3.5, 10, ""), (8.5, 10, "needs PrologEpilogTimeout=11"), (9.0, 20, ""), (5.0, 5, "above MessageTimeout=5"),
        # advice that can be followed: the smaller budget must still hold two scontrol calls
        (8.0, 5, "set [slurm] timeout to 3 or less and [slurm] scontrol_timeout below 1.5, or give"),
        (8.0, 9, "set [slurm] timeout to 7 or less, or give"),
        (8.0, 2, "no prolog budget fits in a MessageTimeout of 2 s or less"),
    ],
)
def test_prolog_budget_must_fit_within_message_timeout(timeout: float, message_timeout: int, problem: str) -> None:
    found = prolog_timeout_problem(SlurmSettings(timeout_s=timeout), message_timeout)
    assert (problem in found) if problem else found == ""


# ---- the commands end to end, with a stand-in scontrol ----------------------------------------


class Site:
    """A config, a stand-in scontrol that records its calls, and a syslog socket."""

    def __init__(self, base: Path, extra: str = "", show: str = "", scontrol_sleep: float = 0) -> None:
        self.base = base
        self.calls = base / "scontrol.calls"
        self.scontrol = base / "scontrol"
        (base / "show.txt").write_text(show)
        self.scontrol.write_text(
            f"#!{sys.executable}\n"
            "import json, sys, time\n"
            f"open({str(self.calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
            f"time.sleep({scontrol_sleep})\n"
            f"if sys.argv[1:2] == ['show']: print(open({str(base / 'show.txt')!r}).read())\n"
        )
        self.scontrol.chmod(0o755)
        self.config = base / "preflight.toml"
        self.config.write_text(
            f'[slurm]\nscontrol = "{self.scontrol}"\nlast_result = "{base}/results/{{mode}}.json"\n'
            f'syslog_socket = "{base}/log.socket"\nscontrol_timeout = 2.0\n{extra}'
        )
        self.syslog = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.syslog.bind(str(base / "log.socket"))
        self.syslog.setblocking(False)

    def made_calls(self) -> list[list[str]]:
        return [json.loads(line) for line in self.calls.read_text().splitlines()] if self.calls.exists() else []

    def result(self, mode: str) -> dict[str, object]:
        data: dict[str, object] = json.loads((self.base / "results" / f"{mode}.json").read_text())
        return data

    def logged(self) -> list[str]:
        return drain_datagrams(self.syslog)


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path)


JOB = {"SLURM_JOB_ID": "4242", "SLURMD_NODENAME": "gpu017", "SLURM_JOB_GPUS": "0,1", "PATH": ""}


def test_prolog_on_a_clean_root_calls_nothing(run_cli: Runner, clean_root: Path, site: Site) -> None:
    result = run_cli("slurm", "prolog", "--root", str(clean_root), "--config", str(site.config), env=JOB)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("preflight ok (prolog job 4242)")
    assert site.made_calls() == [] and site.logged() == []
    written = site.result("prolog")
    assert written["schema"] == "preflight-slurm-result/1" and written["verdict"] == "clean" and written["actions"] == []
    jsonschema.validate(written["report"], REPORT_SCHEMA)
    # root's alone: it names the previous job's user, comment and nodes
    assert stat.S_IMODE((site.base / "results" / "prolog.json").stat().st_mode) == 0o600


def test_prolog_on_the_planted_root_drains_once_with_the_reason(run_cli: Runner, example_root: Path, site: Site) -> None:
    result = run_cli("slurm", "prolog", "--root", str(example_root), "--config", str(site.config), env=JOB)
    assert result.returncode == 2, result.stderr
    reason = result.stdout.strip()
    assert reason.startswith("preflight: DNS001,GDR001,MEM001,MEM002,PCI001 ") and reason.endswith("(prolog job 4242)")
    assert site.made_calls() == [["update", "NodeName=gpu017", "State=DRAIN", f"Reason={reason}"]]
    assert any(line.startswith("<27>preflight[") and reason in line for line in site.logged())
    written = site.result("prolog")
    assert written["verdict"] == "drain" and written["reason"] == reason and written["exit_code"] == 2
    jsonschema.validate(written["report"], REPORT_SCHEMA)


def test_prolog_drain_can_be_switched_off(run_cli: Runner, example_root: Path, tmp_path: Path) -> None:
    site = Site(tmp_path, "drain = false\n")
    result = run_cli("slurm", "prolog", "--root", str(example_root), "--config", str(site.config), env=JOB)
    assert result.returncode == 2 and result.stdout.startswith("preflight: ")
    assert site.made_calls() == []


def test_a_hung_scontrol_is_killed_and_never_retried(run_cli: Runner, example_root: Path, tmp_path: Path) -> None:
    site = Site(tmp_path, "timeout = 5.0\n", scontrol_sleep=60)
    # scontrol would sleep 60 s: a run that waited for it would run into this 30 s hang guard.
    result = run_cli("slurm", "prolog", "--root", str(example_root), "--config", str(site.config), env=JOB, timeout=30)
    assert result.returncode == 2
    assert len(site.made_calls()) == 1
    assert [a["status"] for a in site.result("prolog")["actions"]] == ["timeout"]  # type: ignore[index]


def test_cpu_only_job_skips_gpu_and_rdma_references(run_cli: Runner, example_root: Path, site: Site) -> None:
    result = run_cli("slurm", "prolog", "--root", str(example_root), "--config", str(site.config), env={**JOB, "SLURM_JOB_GPUS": ""})
    assert result.returncode == 2
    assert result.stdout.startswith("preflight: DNS001 hostname-resolution-broken on gpu017 (prolog job 4242)")
    judged = {f["id"] for f in site.result("prolog")["report"]["findings"]}  # type: ignore[index]
    assert "DNS001" in judged and not judged & {"MEM001", "GDR001", "PCI001", "GPU001", "IB009"}
    assert site.result("prolog")["notes"] == []


def test_job_without_gpus_on_a_cluster_without_gpu_gres_is_judged_whole(run_cli: Runner, clean_root: Path, site: Site) -> None:
    """Slurm sets SLURM_JOB_GPUS only for GPUs given as GRES: where slurm.conf's GresTypes has no
    gpu (whole-node jobs), a job without it may use every GPU and is checked for all of them; where
    GresTypes names gpu it is a CPU job, and the clean line says what was skipped."""
    cpu_job = {**JOB, "SLURM_JOB_GPUS": ""}
    result = run_cli("slurm", "prolog", "--root", str(clean_root), "--config", str(site.config), env=cpu_job)
    assert result.returncode == 0
    assert "; skipped for no SLURM_JOB_GPUS: GPU, GDR, NVL, IB, ROCE, EFA, PCI, TOPO, MEM, NCCL," in result.stdout
    slurm_conf = clean_root / "etc/slurm/slurm.conf"
    slurm_conf.write_text(slurm_conf.read_text().replace("GresTypes=gpu\n", ""))
    nvml_path = clean_root / ".preflight" / "nvml.json"
    nvml = json.loads(nvml_path.read_text())
    nvml["calls"]["nvmlDeviceGetCount"] = {"error": "NVML_ERROR_GPU_IS_LOST"}
    nvml_path.write_text(json.dumps(nvml))
    result = run_cli("slurm", "prolog", "--root", str(clean_root), "--config", str(site.config), env=cpu_job)
    written = site.result("prolog")
    assert result.returncode == 2 and "GPU001" in result.stdout, result.stdout
    assert written["job"]["ignored"] == []  # type: ignore[index]
    assert written["notes"] == [
        "no SLURM_JOB_GPUS on a cluster that gives no GPUs as GRES (GresTypes not set in /etc/slurm/slurm.conf): judged as using every GPU"
    ]
    slurm_conf.write_text(slurm_conf.read_text() + "Include gres-types.conf\n")
    run_cli("slurm", "prolog", "--root", str(clean_root), "--config", str(site.config), env=cpu_job)
    written = site.result("prolog")
    assert written["verdict"] == "clean" and written["job"]["ignored"]  # type: ignore[index]
    assert "whether the cluster gives GPUs as GRES is not known" in written["notes"][0]  # type: ignore[index]
    # Judged as a GPU job, a one-node job skips what the site lists for those, and says why.
    slurm_conf.write_text(slurm_conf.read_text().replace("Include gres-types.conf\n", ""))
    (site.base / "one").mkdir()
    one_node = Site(site.base / "one", 'single_node_job_ignore = ["IB", "ROCE"]\n')
    nvml_path.write_text(json.dumps({**nvml, "calls": {**nvml["calls"], "nvmlDeviceGetCount": {"result": 8}}}))
    result = run_cli("slurm", "prolog", "--root", str(clean_root), "--config", str(one_node.config), env={**cpu_job, "SLURM_JOB_NODELIST": "gpu017"})
    assert result.returncode == 0 and "; skipped for a one-node job: IB, ROCE," in result.stdout, result.stdout


def test_opted_out_job_is_not_checked(run_cli: Runner, example_root: Path, site: Site) -> None:
    result = run_cli("slurm", "prolog", "--root", str(example_root), "--config", str(site.config), env={**JOB, "SLURM_JOB_EXTRA": "preflight=off"})
    assert result.returncode == 0 and "opted out (SLURM_JOB_EXTRA=preflight=off)" in result.stdout
    written = site.result("prolog")
    assert written["verdict"] == "opted-out" and written["report"] is None
    assert site.made_calls() == [] and any("opted out" in line for line in site.logged())


def test_epilog_uses_its_profile_and_its_own_result_file(run_cli: Runner, example_root: Path, tmp_path: Path) -> None:
    site = Site(tmp_path, 'epilog_profile = "full"\n')
    result = run_cli("slurm", "epilog", "--root", str(example_root), "--config", str(site.config), env=JOB)
    assert result.returncode == 2 and result.stdout.strip().endswith("(epilog job 4242)")
    written = site.result("epilog")
    assert written["mode"] == "epilog" and written["report"]["profile"] == "full"  # type: ignore[index]


@pytest.mark.parametrize(
    ("state", "reason", "updated"),
    [
        ("IDLE+DRAIN", "preflight: MEM001 memlock-limit-too-low on slurmd (prolog job 4242)", False),  # the job never ran
        ("MIXED+DRAIN", "admin: replacing DIMM B3", False),
        ("DOWN*", "Not responding", False),
        ("IDLE", "", True),
        ("", "", True),  # state unreadable: still leave a meaningful reason
    ],
)
def test_epilog_keeps_a_reason_already_set(run_cli: Runner, example_root: Path, tmp_path: Path, state: str, reason: str, updated: bool) -> None:
    site = Site(tmp_path, show=show_node(state, reason) if state else "slurm_load_node error: Unable to contact slurm controller")
    result = run_cli("slurm", "epilog", "--root", str(example_root), "--config", str(site.config), env=JOB)
    assert result.returncode == 2, result.stdout + result.stderr
    calls = site.made_calls()
    assert calls[0] == ["show", "node", "-o", "gpu017"]
    if updated:
        assert [call[:3] for call in calls[1:]] == [["update", "NodeName=gpu017", "State=DRAIN"]]
        assert calls[1][3].endswith("(epilog job 4242)")
    else:
        assert len(calls) == 1
        assert result.stdout.strip().endswith(f"(node already {state} with reason {reason!r}; kept)")
        assert site.result("epilog")["node_state"] == {"state": state, "reason": reason}


def test_healthcheck_budget_is_cut_to_end_before_slurmd_kills_it(run_cli: Runner, clean_root: Path, site: Site) -> None:
    """slurmd kills HealthCheckProgram at the node's HealthCheckTimeout (Slurm 26.05), else at 60 s: a
    budget that would outlast it is cut to end 2 s before, and the cut is noted; one that fits is
    kept. No slurmd accepts a limit of 65535 s or more, so neither does --timeout nor the config."""
    refused = run_cli("slurm", "healthcheck", "--root", str(clean_root), "--config", str(site.config), "--timeout", "70000")
    assert refused.returncode == 3
    assert "--timeout 70000 must be below 65535 (the longest HealthCheckTimeout slurmd accepts)" in refused.stderr
    with pytest.raises(ConfigError, match="slurm.healthcheck_timeout: 70000 must be below 65535"):
        config("[slurm]\nhealthcheck_timeout = 70000\n")
    assert site.made_calls() == []

    run_cli("slurm", "healthcheck", "--root", str(clean_root), "--config", str(site.config), "--timeout", "120")
    written = site.result("healthcheck")
    assert written["kill_time"] == {"seconds": 60, "source": "HealthCheckTimeout not set in /etc/slurm/slurm.conf: Slurm's default (60 s)"}
    assert written["notes"] == [
        "budget cut from 120 s to 58 s: slurmd kills the healthcheck at 60 s "
        "(HealthCheckTimeout not set in /etc/slurm/slurm.conf: Slurm's default (60 s))"
    ]
    assert any("budget cut from 120 s to 58 s" in line for line in site.logged())

    slurm_conf = clean_root / "etc/slurm/slurm.conf"
    lines = slurm_conf.read_text().splitlines()
    slurm_conf.write_text("\n".join([*lines, "HealthCheckTimeout=20"]) + "\n")
    run_cli("slurm", "healthcheck", "--root", str(clean_root), "--config", str(site.config))
    written = site.result("healthcheck")
    assert written["kill_time"]["seconds"] == 20  # type: ignore[index]
    assert written["notes"] == [
        f"budget cut from 50 s to 18 s: slurmd kills the healthcheck at 20 s "
        f"(HealthCheckTimeout=20 (/etc/slurm/slurm.conf:{len(lines) + 1}))"
    ]

    slurm_conf.write_text("\n".join([*lines, "HealthCheckTimeout=300"]) + "\n")
    run_cli("slurm", "healthcheck", "--root", str(clean_root), "--config", str(site.config), "--timeout", "120")
    written = site.result("healthcheck")
    assert written["kill_time"]["seconds"] == 300 and written["notes"] == []  # type: ignore[index]


def test_slurm_config_sets_health_check_timeout_only_where_the_budget_needs_it() -> None:
    """HealthCheckTimeout is printed only for a budget slurmd's default 60 s cannot hold: slurmd
    before 26.05 refuse the key."""
    assert "HealthCheckTimeout" not in slurm_conf_lines(config(""))
    lines = slurm_conf_lines(config("[slurm]\nhealthcheck_timeout = 100\n")).splitlines()
    assert "HealthCheckTimeout=102" in lines
    assert any("Slurm 26.05 and later only" in line for line in lines)


def test_slurm_help_texts_describe_each_mode(run_cli: Runner) -> None:
    healthcheck = run_cli("slurm", "healthcheck", "--help", env={"COLUMNS": "200"}).stdout
    assert "slurm.healthcheck_timeout, 50 s" in healthcheck and "HealthCheckTimeout, else 60 s" in healthcheck and "slurm.timeout," not in healthcheck
    prolog = run_cli("slurm", "prolog", "--help", env={"COLUMNS": "200"}).stdout
    assert "slurm.timeout, 8 s" in prolog and "requeues a batch job held" in prolog
    epilog = run_cli("slurm", "epilog", "--help", env={"COLUMNS": "200"}).stdout
    assert "Slurm Epilog: after each job" in epilog and "which is kept" in epilog
    assert "requeue" not in epilog and "the job may run" not in epilog


def test_hanging_probe_does_not_drain_by_default_but_does_fail_closed(run_cli: Runner, clean_root: Path, tmp_path: Path) -> None:
    nvml_path = clean_root / ".preflight" / "nvml.json"
    nvml = json.loads(nvml_path.read_text())
    nvml["calls"]["nvmlDeviceGetCount"] = {"hang": True}
    nvml_path.write_text(json.dumps(nvml))
    default = Site(tmp_path, "timeout = 5.0\n")
    # The NVML call never returns: a verdict at all means the run stopped waiting for it
    # (run_cli's subprocess timeout is only a hang guard; bench/deadlines.py times this run).
    result = run_cli("slurm", "prolog", "--root", str(clean_root), "--config", str(default.config), env=JOB)
    assert result.returncode == 0 and default.result("prolog")["verdict"] == "undecided", result.stdout
    assert default.made_calls() == []
    closed_dir = tmp_path / "closed"
    closed_dir.mkdir()
    closed = Site(closed_dir, "timeout = 5.0\nfail_closed = true\n")
    result = run_cli("slurm", "prolog", "--root", str(clean_root), "--config", str(closed.config), env=JOB)
    assert result.returncode == 2 and "GPU001" in result.stdout and "unknown" in result.stdout
    assert len(closed.made_calls()) == 1


def test_prolog_ends_before_slurmd_kills_it(run_cli: Runner, clean_root: Path, site: Site) -> None:
    """A prolog slurmd kills drains the node: where slurm.conf limits the prolog (PrologEpilogTimeout,
    PrologTimeout) below the budget, the run ends 2 s before the limit, even on a hung NVML call, and
    says so; without a limit (Slurm's default) nothing is cut."""
    run_cli("slurm", "prolog", "--root", str(clean_root), "--config", str(site.config), env=JOB)
    written = site.result("prolog")
    assert written["notes"] == [] and written["kill_time"] == {
        "seconds": None, "source": "neither PrologTimeout nor PrologEpilogTimeout set in /etc/slurm/slurm.conf: Slurm's default (no limit)",
    }
    nvml_path = clean_root / ".preflight" / "nvml.json"
    nvml = json.loads(nvml_path.read_text())
    nvml["calls"]["nvmlDeviceGetCount"] = {"hang": True}
    nvml_path.write_text(json.dumps(nvml))
    slurm_conf = clean_root / "etc/slurm/slurm.conf"
    slurm_conf.write_text(slurm_conf.read_text() + "PrologEpilogTimeout=30\nPrologTimeout=5\n")
    result = run_cli("slurm", "prolog", "--root", str(clean_root), "--config", str(site.config), env=JOB)
    written = site.result("prolog")
    assert result.returncode == 0 and written["verdict"] == "undecided", result.stdout
    assert written["kill_time"]["seconds"] == 5  # type: ignore[index]
    assert written["notes"] == [
        f"budget cut from 8 s to 3 s: slurmd kills the prolog at 5 s (PrologTimeout=5 (/etc/slurm/slurm.conf:{len(slurm_conf.read_text().splitlines())}))"
    ]


def test_broken_config_never_fails_a_job_and_leaves_a_trace(run_cli: Runner, example_root: Path, site: Site) -> None:
    """No verdict: the job runs (exit 0), and the reason is on stderr (slurmd logs it), in syslog
    at error level and in the last-result file, which the broken config's valid keys still name."""
    site.config.write_text(site.config.read_text() + 'drain_severity = "fatal"\n')
    prolog = run_cli("slurm", "prolog", "--root", str(example_root), "--config", str(site.config), env=JOB)
    assert prolog.returncode == 0 and prolog.stdout == ""
    assert prolog.stderr.startswith("preflight: no verdict (prolog): ") and "slurm.drain_severity" in prolog.stderr
    written = site.result("prolog")
    assert written["verdict"] == "no-verdict" and written["exit_code"] == 0 and written["node"] == "gpu017"
    assert "slurm.drain_severity: 'fatal' must be one of" in written["errors"][0]  # type: ignore[index]
    assert [line.split(": ", 1)[1] for line in site.logged() if line.startswith("<27>preflight[")] == [prolog.stderr.strip()]
    healthcheck = run_cli("slurm", "healthcheck", "--root", str(example_root), "--config", str(site.config), env=JOB)
    assert healthcheck.returncode == 3 and site.result("healthcheck")["verdict"] == "no-verdict"
    assert site.made_calls() == []
    site.config.write_text("this is = = not TOML\n" + site.config.read_text())
    epilog = run_cli("slurm", "epilog", "--root", str(example_root), "--config", str(site.config), env=JOB)
    assert epilog.returncode == 0 and "not valid TOML" in epilog.stderr
    assert site.result("epilog")["verdict"] == "no-verdict"  # where the config says, not the default path


def test_wrong_root_never_fails_a_job_and_leaves_a_trace(run_cli: Runner, site: Site, tmp_path: Path) -> None:
    prolog = run_cli("slurm", "prolog", "--root", str(tmp_path / "nope"), "--config", str(site.config), env=JOB)
    assert prolog.returncode == 0 and f"no verdict (prolog): --root {tmp_path / 'nope'}: no such directory" in prolog.stderr
    written = site.result("prolog")
    assert written["verdict"] == "no-verdict" and written["job"]["job_id"] == "4242"  # type: ignore[index]
    assert any(line.startswith("<27>") and "no such directory" in line for line in site.logged())


def test_unwritable_last_result_is_reported_but_does_not_change_the_verdict(run_cli: Runner, clean_root: Path, tmp_path: Path) -> None:
    (tmp_path / "results").write_text("a file where the directory should be")
    site = Site(tmp_path)
    result = run_cli("slurm", "prolog", "--root", str(clean_root), "--config", str(site.config), env=JOB)
    assert result.returncode == 0 and "cannot write the last-result file" in result.stderr


@pytest.mark.parametrize(
    ("root_kind", "state", "reason", "expected_calls", "code"),
    [
        ("planted", "IDLE", "", [["update", "NodeName=gpu017", "State=DRAIN"]], 2),
        ("planted", "IDLE+DRAIN", "admin: bad DIMM", [], 2),
        ("planted", "DOWN*", "Not responding", [], 2),
        ("planted", "IDLE+DRAIN", "preflight: GPU001 (prolog job 3)", [["update", "NodeName=gpu017", "State=DRAIN"]], 2),
        ("clean", "IDLE+DRAIN", "preflight: MEM001 (prolog job 3)", [["update", "NodeName=gpu017", "State=RESUME"]], 0),
        ("clean", "MIXED+DRAIN", "admin: bad DIMM", [], 0),
        ("clean", "IDLE", "", [], 0),
    ],
)
def test_healthcheck_drains_and_resumes_only_what_it_owns(
    run_cli: Runner, clean_root: Path, tmp_path: Path, root_kind: str, state: str, reason: str, expected_calls: list[list[str]], code: int
) -> None:
    site = Site(tmp_path, show=show_node(state, reason))
    root = clean_root if root_kind == "clean" else EXAMPLE_ROOT
    result = run_cli("slurm", "healthcheck", "--root", str(root), "--config", str(site.config), env={"SLURMD_NODENAME": "gpu017"})
    assert result.returncode == code, result.stdout + result.stderr
    calls = site.made_calls()
    assert calls[0] == ["show", "node", "-o", "gpu017"]
    assert [call[:3] for call in calls[1:]] == expected_calls
    if expected_calls and expected_calls[0][2] == "State=DRAIN":
        assert calls[1][3].startswith("Reason=preflight: ") and calls[1][3].endswith("(healthcheck)")
    if reason and not reason.startswith("preflight:"):
        assert "left alone" in result.stdout


@pytest.mark.parametrize(("state", "drained"), [("MIXED", False), ("ALLOCATED+DRAIN", False), ("IDLE", True)])
def test_healthcheck_beside_running_jobs_does_not_drain_for_what_they_fill(run_cli: Runner, tmp_path: Path, state: str, drained: bool) -> None:
    """A vLLM container whose /dev/shm has no room for a ring (VLLM001): on a node running jobs the
    space may be theirs, so the health check leaves the node alone and says so; on an idle node
    nothing of a job's holds it, and the node drains."""
    site = Site(tmp_path, show=show_node(state))
    root = REPO / "tests" / "fixtures" / "nodes" / "vllm-container"
    result = run_cli("slurm", "healthcheck", "--root", str(root), "--config", str(site.config), env={"SLURMD_NODENAME": "gpu017"})
    calls = site.made_calls()
    assert (any(call[:3] == ["update", "NodeName=gpu017", "State=DRAIN"] for call in calls), result.returncode) == (drained, 2 if drained else 0)
    if not drained:
        assert result.stdout.startswith(f"preflight: gpu017 runs jobs ({state}), whose own use may fill VLLM001 (/dev/shm space): not drained")
        assert site.result("healthcheck")["verdict"] == "undecided"


VLLM_CONTAINER = REPO / "tests" / "fixtures" / "nodes" / "vllm-container"


@pytest.mark.parametrize(
    ("jobs", "drained"),
    [
        (["system.slice/slurmstepd.scope/job_4242", "system.slice/slurmstepd.scope/job_4177"], False),  # cgroup v2
        (["system.slice/gpu017_slurmstepd.scope/job_4177"], False),  # v2, several slurmd per host
        (["freezer/slurm/uid_1000/job_4177", "freezer/slurm/uid_1001/job_4242"], False),  # cgroup v1
        (["system.slice/slurmstepd.scope/job_4242", "system.slice/slurmstepd.scope/system"], True),  # only the job itself
        (["system.slice/slurmd.service"], True),  # no slurmstepd tree: nobody can say, judged as found
    ],
)
@pytest.mark.parametrize("mode", ["prolog", "epilog"])
def test_prolog_and_epilog_beside_other_jobs_do_not_drain_for_what_they_fill(
    run_cli: Runner, tmp_path: Path, mode: str, jobs: list[str], drained: bool
) -> None:
    """/dev/shm without room for vLLM's ring (VLLM001) on a node where other jobs run: their own
    files may hold it, so the prolog or epilog of this job lets the node be and says why, without
    calling Slurm; where no other job's cgroup is seen the node drains as before."""
    root = tmp_path / "root"
    shutil.copytree(VLLM_CONTAINER, root)
    for job in jobs:
        (root / "sys" / "fs" / "cgroup" / job).mkdir(parents=True)
    site = Site(tmp_path)
    result = run_cli("slurm", mode, "--root", str(root), "--config", str(site.config), env=JOB)
    calls = site.made_calls()
    if drained:
        assert result.returncode == 2 and result.stdout.startswith("preflight: VLLM001 "), result.stdout + result.stderr
        assert calls[-1][:3] == ["update", "NodeName=gpu017", "State=DRAIN"]
    else:
        assert result.returncode == 0 and calls == [], result.stdout + result.stderr
        assert result.stdout.strip() == (
            f"preflight: gpu017 also runs job(s) 4177, whose own use may fill VLLM001 (/dev/shm space): not drained ({mode} job 4242)"
        )
        assert site.result(mode)["verdict"] == "undecided"
        assert any(line.startswith("<29>preflight[") for line in site.logged())


@pytest.mark.parametrize(("jobs", "drained"), [(["sEKNKTV3WPV500", "sEKNKTV3WPV501"], False), (["sEKNKTV3WPV500"], True)])
def test_a_prolog_on_slurm_26_05_sees_other_jobs_by_their_sluid(run_cli: Runner, tmp_path: Path, jobs: list[str], drained: bool) -> None:
    """Slurm 26.05 names job cgroups by SLUID (CgroupJobIdPaths=no, the default): another job's
    /dev/shm use does not drain the node, and the prolog's own job (SLURM_JOB_SLUID) is not another."""
    root = tmp_path / "root"
    shutil.copytree(VLLM_CONTAINER, root)
    for job in jobs:
        (root / "sys/fs/cgroup/system.slice/slurmstepd.scope" / job).mkdir(parents=True)
    site = Site(tmp_path)
    result = run_cli("slurm", "prolog", "--root", str(root), "--config", str(site.config), env={**JOB, "SLURM_JOB_SLUID": "sEKNKTV3WPV500"})
    assert result.returncode == (2 if drained else 0), result.stdout + result.stderr
    if not drained:
        assert "also runs job(s) sEKNKTV3WPV501," in result.stdout and site.made_calls() == []


def test_other_jobs_on_node_reads_only_slurmstepd_job_cgroups(tmp_path: Path) -> None:
    assert other_jobs_on_node(NodeFS(str(tmp_path)), "7") is None  # no cgroup tree at all
    for job in ("job_7", "job_12", "job_9", "step_extern", "job_x1", "job_" + "9" * 11):
        (tmp_path / "sys/fs/cgroup/user.slice/slurmstepd.scope" / job).mkdir(parents=True)
    assert other_jobs_on_node(NodeFS(str(tmp_path)), "7") == ("9", "12")


def test_other_jobs_on_node_knows_slurm_26_05_sluid_cgroups(tmp_path: Path) -> None:
    """From Slurm 26.05 cgroup/v2 names each job's directory by its SLUID unless
    CgroupJobIdPaths=yes (cgroup_v2.c); the prolog gets its own as SLURM_JOB_SLUID."""
    for job in ("sEKNKTV3WPV500", "sEKNKTV3WPV501", "s0123", "slurm.conf"):
        (tmp_path / "sys/fs/cgroup/system.slice/slurmstepd.scope" / job).mkdir(parents=True)
    assert other_jobs_on_node(NodeFS(str(tmp_path)), "7", "sEKNKTV3WPV500") == ("sEKNKTV3WPV501",)
    assert other_jobs_on_node(NodeFS(str(tmp_path)), "7") == ("sEKNKTV3WPV500", "sEKNKTV3WPV501")


def test_healthcheck_does_not_repeat_an_identical_drain(run_cli: Runner, tmp_path: Path) -> None:
    first = Site(tmp_path, show=show_node("IDLE"))
    result = run_cli("slurm", "healthcheck", "--root", str(EXAMPLE_ROOT), "--config", str(first.config), env={"SLURMD_NODENAME": "gpu017"})
    reason = result.stdout.strip()
    (tmp_path / "show.txt").write_text(show_node("IDLE+DRAIN", reason))
    first.calls.unlink()
    again = run_cli("slurm", "healthcheck", "--root", str(EXAMPLE_ROOT), "--config", str(first.config), env={"SLURMD_NODENAME": "gpu017"})
    assert again.returncode == 2 and "already drained" in again.stdout
    assert first.made_calls() == [["show", "node", "-o", "gpu017"]]


def test_undecided_healthcheck_names_the_unknowns_that_keep_the_node_drained(run_cli: Runner, clean_root: Path, tmp_path: Path) -> None:
    nvml_path = clean_root / ".preflight" / "nvml.json"
    nvml = json.loads(nvml_path.read_text())
    nvml["calls"]["nvmlDeviceGetCount"] = {"hang": True}
    nvml_path.write_text(json.dumps(nvml))
    site = Site(tmp_path, "healthcheck_timeout = 8.0\n", show=show_node("IDLE+DRAIN", "preflight: GPU001 (prolog job 3)"))
    result = run_cli("slurm", "healthcheck", "--root", str(clean_root), "--config", str(site.config), env={"SLURMD_NODENAME": "gpu017"})
    assert result.returncode == 0 and site.result("healthcheck")["verdict"] == "undecided"
    message = result.stdout.strip()
    assert message.startswith("preflight: gpu017 stays drained ('preflight: GPU001 (prolog job 3)') while unknown: GPU001 ")
    assert "(probe gpus: timed out after " in message and message.endswith(" more")
    assert site.made_calls() == [["show", "node", "-o", "gpu017"]]  # no resume
    assert any(line.startswith("<29>preflight[") and message in line for line in site.logged())


@pytest.mark.parametrize("show", ["", "Node gpu017 not found", "slurm_load_node error: Unable to contact slurm controller (connect failure)"])
def test_healthcheck_leaves_the_node_alone_when_its_state_cannot_be_read(run_cli: Runner, tmp_path: Path, show: str) -> None:
    site = Site(tmp_path, show=show)
    result = run_cli("slurm", "healthcheck", "--root", str(EXAMPLE_ROOT), "--config", str(site.config), env={"SLURMD_NODENAME": "gpu017"})
    assert result.returncode == 2 and "left alone" in result.stdout
    assert site.made_calls() == [["show", "node", "-o", "gpu017"]]


def test_healthcheck_before_slurmd_registers_does_not_hang(run_cli: Runner, tmp_path: Path) -> None:
    """The first run at slurmd start: scontrol can hang (NHC #159); the budget holds."""
    site = Site(tmp_path, "healthcheck_timeout = 8.0\n", show=show_node("IDLE"), scontrol_sleep=60)
    # scontrol would sleep 60 s: a run that waited for it would run into this 30 s hang guard.
    result = run_cli("slurm", "healthcheck", "--root", str(EXAMPLE_ROOT), "--config", str(site.config), env={"SLURMD_NODENAME": "gpu017"}, timeout=30)
    assert result.returncode == 2 and "left alone" in result.stdout
    assert len(site.made_calls()) == 1


def test_node_name_comes_from_config_then_slurmd(run_cli: Runner, example_root: Path, tmp_path: Path) -> None:
    site = Site(tmp_path, 'node_name = "gpu-a17"\n')
    run_cli("slurm", "prolog", "--root", str(example_root), "--config", str(site.config), env=JOB)
    assert site.made_calls()[0][1] == "NodeName=gpu-a17"


def test_slurm_config_prints_only_slurm_conf_syntax_with_the_wrappers_as_comments(run_cli: Runner, site: Site, tmp_path: Path) -> None:
    bare = tmp_path / "bare-slurm.conf"
    bare.write_text("ClusterName=lab\n")
    result = run_cli("slurm", "config", "--config", str(site.config), env={"SLURM_CONF": str(bare)})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "Prolog=/etc/slurm/preflight-prolog" in lines and "PrologEpilogTimeout=10" in lines
    settings = [line for line in lines if line and not line.startswith("#")]
    assert [line.split("=", 1)[0] for line in settings] == [
        "Prolog", "Epilog", "PrologFlags", "PrologEpilogTimeout", "HealthCheckProgram", "HealthCheckInterval", "HealthCheckNodeState",
    ]
    # each wrapper is a separable section: the lines after its marker, uncommented
    section = result.stdout.split("# ---- /etc/slurm/preflight-healthcheck\n", 1)[1]
    script = [line[2:] for line in section.splitlines() if not line.startswith("# ---- ")]
    assert script[0] == "#!/bin/sh" and script[-1].endswith(f"slurm healthcheck --config {site.config}")


def test_slurm_config_keeps_the_sites_own_health_check_and_prolog_flags(run_cli: Runner, site: Site, tmp_path: Path) -> None:
    """Included after a slurm.conf that runs LBNL NHC and PrologFlags=Alloc,Contain, the lines
    must not switch NHC off or drop Contain (the last assignment wins): the site's health check
    stays, ours is a comment saying why, and the flags are merged."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=lab\nHealthCheckProgram=/usr/sbin/nhc\nHealthCheckInterval=300\nHealthCheckNodeState=IDLE\n"
                    "PrologFlags=Contain,X11\n")
    result = run_cli("slurm", "config", "--config", str(site.config), env={"SLURM_CONF": str(conf)})
    assert result.returncode == 0, result.stderr
    settings = [line for line in result.stdout.splitlines() if line and not line.startswith("#")]
    assert [line.split("=", 1)[0] for line in settings] == ["Prolog", "Epilog", "PrologFlags", "PrologEpilogTimeout"]
    assert "PrologFlags=Contain,X11,Alloc" in settings
    assert f"# {conf}:2 already sets HealthCheckProgram=/usr/sbin/nhc: ours would replace it. Call preflight" in result.stdout
    assert "#HealthCheckProgram=/etc/slurm/preflight-healthcheck" in result.stdout and "#HealthCheckNodeState=ANY" in result.stdout


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--wrapper-dir", "relative"], "--wrapper-dir relative: must be an existing directory"),
        (["--wrapper-dir", "/nonexistent/slurm"], "must be an existing directory"),
        (["--message-timeout", "8"], "needs PrologEpilogTimeout=10 (2 s more, to start and write the result), above MessageTimeout=8"),
        (["--interval", "30"], "--interval 30 must be longer than [slurm] healthcheck_timeout (50 s)"),
    ],
)
def test_slurm_config_refuses_what_cannot_work(run_cli: Runner, site: Site, arguments: list[str], message: str) -> None:
    result = run_cli("slurm", "config", "--config", str(site.config), *arguments)
    assert result.returncode == 3 and result.stdout == ""
    assert result.stderr.startswith("preflight: error: ") and message in result.stderr and "Traceback" not in result.stderr


def test_slurm_config_interval_must_exceed_the_health_check_timeout_it_prints(run_cli: Runner, tmp_path: Path) -> None:
    """Slurm 26.05 logs an error when HealthCheckTimeout is not below HealthCheckInterval."""
    config = tmp_path / "long.toml"
    config.write_text("[slurm]\nhealthcheck_timeout = 100\n")
    refused = run_cli("slurm", "config", "--config", str(config), "--interval", "101")
    assert refused.returncode == 3 and "--interval 101 must be longer than the HealthCheckTimeout=102 printed" in refused.stderr
    accepted = run_cli("slurm", "config", "--config", str(config), "--interval", "103")
    assert accepted.returncode == 0 and "HealthCheckTimeout=102" in accepted.stdout and "HealthCheckInterval=103" in accepted.stdout


def test_slurm_config_refuses_a_prolog_budget_slurm_would_cut_short(run_cli: Runner, tmp_path: Path) -> None:
    site = Site(tmp_path, "timeout = 9.0\n")
    refused = run_cli("slurm", "config", "--config", str(site.config))
    assert refused.returncode == 3 and "[slurm] timeout = 9 needs PrologEpilogTimeout=11" in refused.stderr
    assert "set [slurm] timeout to 8 or less" in refused.stderr
    accepted = run_cli("slurm", "config", "--config", str(site.config), "--message-timeout", "15")
    assert accepted.returncode == 0 and "PrologEpilogTimeout=11" in accepted.stdout.splitlines()


def test_slurm_config_reads_the_node_config_by_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without --config, the node's own config (/etc/preflight/preflight.toml) decides the
    timeouts, as it does for the prolog the lines will run; a missing one means the defaults."""
    from typer.testing import CliRunner

    import preflight.run
    from preflight.cli.app import build_app

    app = build_app()

    site = Site(tmp_path, "timeout = 9.0\n")
    monkeypatch.setattr(preflight.run, "DEFAULT_CONFIG_PATH", str(site.config))
    refused = CliRunner().invoke(app, ["slurm", "config"])
    assert refused.exit_code == 3 and "[slurm] timeout = 9 needs PrologEpilogTimeout=11" in refused.output
    monkeypatch.setattr(preflight.run, "DEFAULT_CONFIG_PATH", str(tmp_path / "absent.toml"))
    defaults = CliRunner().invoke(app, ["slurm", "config"])
    assert defaults.exit_code == 0 and "PrologEpilogTimeout=10" in defaults.output.splitlines()


def test_slurm_config_writes_working_wrappers_into_wrapper_dir(run_cli: Runner, clean_root: Path, site: Site, tmp_path: Path) -> None:
    """--wrapper-dir: the wrappers are files (mode 0755) and stdout is only the slurm.conf lines."""
    wrappers = tmp_path / "wrappers"
    wrappers.mkdir()
    result = run_cli("slurm", "config", "--config", str(site.config), "--wrapper-dir", str(wrappers))
    assert result.returncode == 0, result.stderr
    assert f"Prolog={wrappers}/preflight-prolog" in result.stdout.splitlines() and "#!/bin/sh" not in result.stdout
    assert sorted(path.name for path in wrappers.iterdir()) == ["preflight-epilog", "preflight-healthcheck", "preflight-prolog"]
    wrapper = wrappers / "preflight-prolog"
    assert stat.S_IMODE(wrapper.stat().st_mode) == 0o755
    # Point the generated wrapper at the clean recording; everything else is as generated.
    wrapper.write_text(wrapper.read_text().replace(" slurm prolog ", f" slurm prolog --root {clean_root} "))
    ran = subprocess.run([str(wrapper)], capture_output=True, text=True, timeout=60, env=JOB, cwd=tmp_path)
    assert ran.returncode == 0 and ran.stdout.startswith("preflight ok (prolog job 4242)"), ran.stdout + ran.stderr


# ---- the fast path ---------------------------------------------------------------------------


def test_the_job_modes_start_without_typer() -> None:
    from preflight.cli.start import fast_command

    for mode in ("prolog", "epilog", "healthcheck"):
        found = fast_command(["slurm", mode, "--root", "/"])
        assert found is not None and found[0].path == ("slurm", mode) and found[1] == ["--root", "/"]
    assert fast_command(["slurm", "config"]) is None  # rare, and typer explains its integer limits


def test_fast_path_falls_back_to_typer_for_help_and_typos(run_cli: Runner) -> None:
    helped = run_cli("slurm", "prolog", "--help")
    assert helped.returncode == 0 and "--root" in helped.stdout
    # A prolog or epilog whose command line is not understood lets the job run: slurmd drains the
    # node and requeues the job on any other exit (slurm.conf(5), Prolog). A health check says 3.
    typo = run_cli("slurm", "prolog", "--rooot", "/")
    assert typo.returncode == 0 and "--rooot" in typo.stderr and "no verdict (prolog)" in typo.stderr
    bad_number = run_cli("slurm", "epilog", "--timeout", "soon")
    assert bad_number.returncode == 0 and "no verdict (epilog)" in bad_number.stderr
    assert run_cli("slurm", "healthcheck", "--timeout", "soon").returncode == 3


def test_a_crash_before_the_session_exists_fails_no_job(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """run_slurm never raises: a bug in its own setup (the job's scope, the node's name) lets
    the job run, as a bug later in the run does."""
    import preflight.slurm as slurm

    def broken(*_: object) -> None:
        raise ValueError("a bug")

    monkeypatch.setattr(slurm, "job_scope", broken)
    assert slurm.run_slurm(slurm.SlurmArgs("prolog"), {"SLURM_JOB_ID": "7"}) == 0
    assert slurm.run_slurm(slurm.SlurmArgs("healthcheck"), {}) == 3
    assert "internal error: ValueError: a bug" in capsys.readouterr().err


def test_slurm_prolog_does_not_import_the_cli_framework(example_root: Path, site: Site) -> None:
    from conftest import HEAVY

    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import sys; from preflight.cli.start import main; main(sys.argv[1:])",
         "slurm", "prolog", "--root", str(example_root), "--config", str(site.config)],
        capture_output=True, text=True, timeout=60, cwd=site.base, env={**JOB, "SLURM_JOB_GPUS": "0"},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    modules = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in result.stderr.splitlines() if line.startswith("import time:") and "|" in line}
    assert "preflight" in modules and modules & HEAVY == set()


def test_a_broken_plugin_or_a_bug_in_preflight_never_fails_a_job(run_cli: Runner, clean_root: Path, site: Site, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "broken.py").write_text("this is not python\n")
    result = run_cli("slurm", "prolog", "--root", str(clean_root), "--config", str(site.config), "--checks-dir", str(plugins), env=JOB)
    assert result.returncode == 0 and "no verdict" in result.stderr and "broken" in result.stderr
    assert site.result("prolog")["verdict"] == "no-verdict" and site.made_calls() == []

    import preflight.slurm as slurm

    def crash(*_: object) -> int:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(slurm, "_judge_node", crash)
    code = slurm.run_slurm(slurm.SlurmArgs("prolog", str(clean_root), str(site.config)), JOB)
    assert code == 0 and "internal error: ZeroDivisionError" in capsys.readouterr().err
    assert slurm.run_slurm(slurm.SlurmArgs("healthcheck", str(clean_root), str(site.config)), JOB) == 3
