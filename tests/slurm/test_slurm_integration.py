"""``preflight slurm`` under a real Slurm: munged, slurmctld and slurmd started by the tests on a
single-node cluster written to a temporary directory, real ``srun``/``sbatch`` jobs.

The Prolog, Epilog and HealthCheck lines of ``slurm.conf`` are the ones ``preflight slurm config``
generates (included from the test's ``slurm.conf``), and so are the wrapper scripts they name,
with ``--root`` added: a symlink the tests switch between recorded roots (clean, planted with
misconfigurations, with an NVML call that hangs, missing). The config sends syslog lines to a
socket the tests listen on; slurmd logs at debug2, the level at which it logs what a prolog that
exits 0 wrote. Two fake GPUs (gres backed by /dev/null and /dev/zero;
TaskPlugin=task/none constrains nothing) make Slurm give jobs ``SLURM_JOB_GPUS``.

Needs root (slurmd runs prologs as root; the daemons here run as root) and Debian's munge,
slurmctld, slurmd and slurm-client packages, which ``.ci/run`` installs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import EXAMPLE_ROOT, drain_datagrams, make_clean, preflight_command
from preflight.slurm_conf import propagated, read_slurm_conf
from preflight.sources import NodeFS

pytestmark = pytest.mark.integration

NODE = "pfnode"
SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol", "squeue", "scancel")
PROLOG_BUDGET_S = 4.0
MESSAGE_TIMEOUT_S = 10  # Slurm's default


def find_program(name: str) -> str | None:
    return shutil.which(name) or next((f"{d}/{name}" for d in SBIN if os.access(f"{d}/{name}", os.X_OK)), None)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Cluster:
    """The running test cluster and what it needs to drive jobs."""

    base: Path
    conf: Path
    env: dict[str, str]
    roots: dict[str, Path]
    syslog: socket.socket
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def use_root(self, name: str) -> None:
        """Point the prolog, epilog and health check at one of the recorded roots, once the
        epilogs of earlier jobs are done (srun returns before its job's epilog has run)."""
        self.wait_for(lambda: "COMPLETING" not in self.node()[0], "earlier jobs' epilogs")
        self.point_root(name)

    def point_root(self, name: str) -> None:
        link = self.base / "root"
        temporary = self.base / "root.new"
        temporary.unlink(missing_ok=True)
        temporary.symlink_to(self.roots[name])
        os.replace(temporary, link)

    def run(self, *argv: str, timeout: float = 60, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        program = find_program(argv[0]) or argv[0]
        return subprocess.run(
            [program, *argv[1:]], capture_output=True, text=True, timeout=timeout, env={**self.env, **(extra_env or {})},
            cwd=self.base,
        )

    def node(self) -> tuple[str, str]:
        """(state, reason) as scontrol shows them."""
        from preflight.slurm import parse_show_node

        shown = self.run("scontrol", "show", "node", "-o", NODE, timeout=15)
        state = parse_show_node(shown.stdout)
        assert state is not None, shown.stdout + shown.stderr
        return state.state, state.reason

    def wait_for(self, predicate: Callable[[], bool], what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.25)
        raise AssertionError(f"timed out waiting for {what}; node: {self.node()}; logs:\n{self.logs()}")

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.base / "log" / name
            if path.exists():
                parts.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-25:]))
        return "\n".join(parts)

    def result(self, mode: str) -> dict[str, object]:
        data: dict[str, object] = json.loads((self.base / "results" / f"slurm-{mode}.json").read_text())
        return data

    def result_for_job(self, mode: str, job_id: str) -> dict[str, object] | None:
        """The last result of ``mode`` if it is about this job (earlier jobs wrote it too)."""
        path = self.base / "results" / f"slurm-{mode}.json"
        if not path.exists():
            return None
        result = self.result(mode)
        return result if result["job"]["job_id"] == job_id else None  # type: ignore[index]

    def syslog_lines(self) -> list[str]:
        return drain_datagrams(self.syslog)

    def healthcheck(self, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """The health check as slurmd or cron runs it: the wrapper, environment SLURMD_NODENAME only."""
        return subprocess.run(
            [str(self.base / "preflight-healthcheck")], capture_output=True, text=True, timeout=60,
            env={"SLURMD_NODENAME": NODE, **(extra_env or {})},
        )

    def resume(self) -> None:
        self.run("scontrol", "update", f"NodeName={NODE}", "State=RESUME")
        # slurmctld pings a resumed node (IDLE*) and allocates it only once slurmd answers; a job
        # submitted before that waits for the next scheduling pass, up to a minute.
        self.wait_for(lambda: "DRAIN" not in self.node()[0] and "*" not in self.node()[0], "the node to resume")


def skip_reason() -> str:
    if os.geteuid() != 0:
        return "needs root: slurmd runs the prolog as root and the test daemons run as root"
    missing = [name for name in PROGRAMS if find_program(name) is None]
    if missing:
        return f"Slurm binaries missing ({', '.join(missing)}): apt-get install munge slurmctld slurmd slurm-client"
    return ""


def generate_config(base: Path) -> Path:
    """``preflight slurm config`` for this cluster: the slurm.conf lines to include, and the
    wrappers, which get the test's --root and SLURM_CONF (HealthCheckProgram runs without it)."""
    generated = subprocess.run(
        [*preflight_command(), "slurm", "config", "--config", str(base / "preflight.toml"), "--wrapper-dir", str(base),
         "--interval", "3600", "--message-timeout", str(MESSAGE_TIMEOUT_S)],
        capture_output=True, text=True, timeout=60, check=True, cwd=base,
    )
    for mode in ("prolog", "epilog", "healthcheck"):
        wrapper = base / f"preflight-{mode}"
        shebang, rest = wrapper.read_text().split("\n", 1)
        rest = rest.replace(f" slurm {mode} ", f" slurm {mode} --root {base}/root ")
        wrapper.write_text(f"{shebang}\nexport SLURM_CONF={base}/slurm.conf\n{rest}")
    included = base / "preflight-slurm.conf"
    included.write_text(generated.stdout)
    return included


def slurm_conf(base: Path, ctld_port: int, slurmd_port: int, munge_socket: Path) -> str:
    # CPUs=1: a node that registers with fewer CPUs than configured is drained by slurmctld; one
    # is always there, and the tests run one job at a time.
    return f"""\
ClusterName=preflighttest
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd.pid
SlurmctldLogFile={base}/log/slurmctld.log
SlurmdLogFile={base}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout={MESSAGE_TIMEOUT_S}
InactiveLimit=0
KillWait=2
MinJobAge=2
GresTypes=gpu
SlurmdDebug=debug2
Include {base}/preflight-slurm.conf
Include limits.conf
NodeName={NODE} NodeAddr=127.0.0.1 NodeHostname={socket.gethostname().split('.')[0]} CPUs=1 Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
"""


def start(cluster: Cluster, argv: list[str], log: str) -> subprocess.Popen[bytes]:
    with open(cluster.base / "log" / log, "wb") as output:
        process = subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT, env=cluster.env, start_new_session=True)
    cluster.processes.append(process)
    return process


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    """Stop the daemons the tests started, by PID, newest first; then anything left in the process
    group each was started in (slurmctld's slurmscriptd, a slurmstepd)."""
    for process in reversed(processes):
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in reversed(processes):
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def build_roots(base: Path) -> dict[str, Path]:
    planted = base / "roots" / "planted"
    shutil.copytree(EXAMPLE_ROOT, planted, symlinks=True)
    clean = base / "roots" / "clean"
    shutil.copytree(EXAMPLE_ROOT, clean, symlinks=True)
    make_clean(clean)
    hanging = base / "roots" / "hanging"
    shutil.copytree(clean, hanging, symlinks=True)
    nvml_path = hanging / ".preflight" / "nvml.json"
    nvml = json.loads(nvml_path.read_text())
    nvml["calls"]["nvmlDeviceGetCount"] = {"hang": True}  # a wedged driver
    nvml_path.write_text(json.dumps(nvml))
    return {"clean": clean, "planted": planted, "hanging": hanging, "missing": base / "roots" / "missing", "busy": busy_root(clean, base)}


def busy_root(clean: Path, base: Path) -> Path:
    """The clean node while a job runs on it: the job's rank 0 listens on torchrun's default port
    29500, its process maps most of GPU 0's BAR1, and GPU 0, busy, is caught in a power peak (HW
    slowdown, no GpuIdle reason)."""
    busy = base / "roots" / "busy"
    shutil.copytree(clean, busy, symlinks=True)
    with (busy / "proc/net/tcp").open("a") as table:
        table.write("  99: 00000000:733C 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1001        0 77001 1 0000000000000000 100 0 0 10 0\n")
    nvml_path = busy / ".preflight" / "nvml.json"
    nvml = json.loads(nvml_path.read_text())
    nvml["calls"]["nvmlDeviceGetBAR1MemoryInfo"]["0"] = {"result": {"bar1Total": 128 << 30, "bar1Free": 20 << 30, "bar1Used": 108 << 30}}
    nvml["calls"].setdefault("nvmlDeviceGetComputeRunningProcesses", {})["0"] = {"result": [{"pid": 4242, "usedGpuMemory": 70 << 30}]}
    nvml["calls"]["nvmlDeviceGetCurrentClocksThrottleReasons"]["0"] = {"result": 0x08}
    nvml_path.write_text(json.dumps(nvml))
    return busy


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("slurm")
    base.chmod(0o755)
    for name in ("state", "spool", "log", "results"):
        (base / name).mkdir()
    munge_dir = base / "munge"
    munge_dir.mkdir(mode=0o700)
    key = munge_dir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    munge_socket = munge_dir / "munge.socket"
    ctld_port, slurmd_port = free_port(), free_port()
    conf = base / "slurm.conf"
    conf.write_text(slurm_conf(base, ctld_port, slurmd_port, munge_socket))
    # Read by slurmctld and by preflight's own reader alike (a relative Include, a continued line).
    (base / "limits.conf").write_text("# jobs keep slurmd's limits\nPropagateResourceLimitsExcept=MEMLOCK,\\\nSTACK  # not the login node's\n")
    (base / "gres.conf").write_text(f"NodeName={NODE} Name=gpu File=/dev/null\nNodeName={NODE} Name=gpu File=/dev/zero\n")
    (base / "preflight.toml").write_text(
        f"""\
[run]
probe_timeout = 2.0

[slurm]
timeout = {PROLOG_BUDGET_S}
scontrol_timeout = 1.5
last_result = "{base}/results/slurm-{{mode}}.json"
syslog_socket = "{base}/syslog.socket"
"""
    )
    generate_config(base)
    syslog = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    syslog.bind(str(base / "syslog.socket"))
    syslog.setblocking(False)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin", "SLURM_CONF": str(conf), "HOME": str(base)}
    cluster = Cluster(base, conf, env, build_roots(base), syslog)
    cluster.point_root("clean")
    try:
        munged = start(cluster, [find_program("munged") or "munged", "--foreground", "--force", f"--socket={munge_socket}",
                                 f"--key-file={key}", f"--pid-file={munge_dir}/munged.pid", f"--seed-file={munge_dir}/seed",
                                 f"--log-file={base}/log/munged.log"], "munged.out")
        cluster.wait_for(lambda: munge_socket.exists() or munged.poll() is not None, "munged's socket", 15)
        assert munged.poll() is None, (base / "log" / "munged.out").read_text()
        start(cluster, [find_program("slurmctld") or "slurmctld", "-D", "-i"], "slurmctld.out")
        cluster.wait_for(lambda: cluster.run("scontrol", "ping", timeout=15).returncode == 0, "slurmctld", 30)
        start(cluster, [find_program("slurmd") or "slurmd", "-D", "-N", NODE], "slurmd.out")
        cluster.wait_for(lambda: cluster.node()[0].startswith("IDLE") and "*" not in cluster.node()[0], "slurmd to register", 30)
        yield cluster
    finally:
        subprocess.run([find_program("scancel") or "scancel", "--partition=debug"], env=env, capture_output=True, timeout=15, check=False)
        stop(cluster.processes)
        syslog.close()


def test_healthcheck_ran_when_slurmd_started_and_left_the_clean_node_alone(cluster: Cluster) -> None:
    result = cluster.result("healthcheck")
    assert result["verdict"] == "clean", result
    assert result["node"] == NODE
    assert all(action["argv"][1] == "show" for action in result["actions"]), result["actions"]  # type: ignore[index]


def test_1_clean_root_job_runs(cluster: Cluster) -> None:
    cluster.use_root("clean")
    job = cluster.run("srun", "--gres=gpu:1", "-N1", "echo", "job ran")
    assert job.returncode == 0 and "job ran" in job.stdout, job.stderr + cluster.logs()
    result = cluster.result("prolog")
    assert result["verdict"] == "clean" and result["exit_code"] == 0, result
    assert result["job"]["gpus"] == [0] and result["job"]["slurm_job_gpus"] == "0"  # type: ignore[index]
    assert result["actions"] == []  # a clean prolog calls nothing
    assert "DRAIN" not in cluster.node()[0]


def test_cpu_only_job_skips_gpu_and_rdma_checks(cluster: Cluster) -> None:
    cluster.use_root("clean")
    job = cluster.run("srun", "-N1", "true")
    assert job.returncode == 0, job.stderr
    result = cluster.result("prolog")
    assert result["job"]["gpus"] is None and "MEM" in result["job"]["ignored"]  # type: ignore[index]
    judged = {finding["id"] for finding in result["report"]["findings"]}  # type: ignore[index]
    assert "DNS001" in judged and not judged & {"MEM001", "GDR001", "GPU001", "PCI001"}


def test_3_opted_out_job_runs_on_the_planted_root(cluster: Cluster) -> None:
    cluster.use_root("planted")
    job = cluster.run("srun", "--gres=gpu:1", "--comment=preflight=off", "-N1", "echo", "opted out")
    assert job.returncode == 0 and "opted out" in job.stdout, job.stderr + cluster.logs()
    result = cluster.result("prolog")
    assert result["verdict"] == "opted-out" and result["job"]["opted_out_by"] == "SLURM_JOB_COMMENT=preflight=off"  # type: ignore[index]
    assert "DRAIN" not in cluster.node()[0]


def test_2_planted_misconfiguration_drains_the_node_and_the_job_does_not_start(cluster: Cluster) -> None:
    cluster.use_root("planted")
    cluster.syslog_lines()
    marker = cluster.base / "job-ran"
    submitted = cluster.run("sbatch", "--parsable", "--gres=gpu:1", f"--output={cluster.base}/job.out", "--wrap", f"touch {marker}")
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    cluster.wait_for(lambda: "DRAIN" in cluster.node()[0], "the node to drain")
    state, reason = cluster.node()
    assert reason.startswith("preflight: ") and f"(prolog job {job_id})" in reason, reason
    for ref_id in ("MEM001", "DNS001", "GDR001", "PCI001"):
        assert ref_id in reason
    # What docs/operators/slurm.md and `preflight slurm config` say: held until `scontrol release`.
    cluster.wait_for(
        lambda: cluster.run("squeue", "-h", "-j", job_id, "-o", "%T|%r").stdout.strip() == "PENDING|launch failed requeued held",
        "the job to be requeued held",
    )
    time.sleep(1)
    assert not marker.exists()
    result = cluster.result("prolog")
    assert result["verdict"] == "drain" and result["reason"] == reason and result["exit_code"] == 2
    assert [action["status"] for action in result["actions"]] == ["ok"]  # type: ignore[index]
    assert any(reason in line for line in cluster.syslog_lines())
    # Slurm runs the epilog of the job that never ran; it finds the same problems but keeps the reason.
    cluster.wait_for(lambda: cluster.result_for_job("epilog", job_id) is not None, "the epilog of the job that never ran")
    epilog = cluster.result("epilog")
    assert epilog["verdict"] == "drain" and str(epilog["reason"]).endswith(f"(epilog job {job_id})"), epilog
    assert [action["argv"][1] for action in epilog["actions"]] == ["show"]  # type: ignore[index]
    assert str(epilog["message"]).endswith(f"with reason {reason!r}; kept)")
    time.sleep(1)  # slurmctld has the epilog's failure by now
    state, kept = cluster.node()
    assert "DRAIN" in state and kept == reason
    cluster.run("scancel", job_id)


def test_2_srun_job_is_cancelled_when_the_prolog_fails(cluster: Cluster) -> None:
    cluster.resume()
    cluster.use_root("planted")
    job = cluster.run("srun", "--gres=gpu:1", "-N1", "echo", "must not run")
    assert job.returncode != 0 and "must not run" not in job.stdout
    assert "Prolog failure" in job.stderr, job.stderr
    job_id = str(cluster.result("prolog")["job"]["job_id"])  # type: ignore[index]
    cluster.wait_for(lambda: cluster.result_for_job("epilog", job_id) is not None, "the epilog")
    time.sleep(1)
    state, reason = cluster.node()
    assert "DRAIN" in state and reason.endswith(f"(prolog job {job_id})"), reason


def test_2_nohold_on_prolog_fail_requeues_batch_jobs_without_the_hold(cluster: Cluster) -> None:
    """The alternative `preflight slurm config` proposes, uncommented, loads and does what it says."""
    included = cluster.base / "preflight-slurm.conf"
    generated = included.read_text()
    assert "\n#SchedulerParameters=nohold_on_prolog_fail\n" in generated
    included.write_text(generated.replace("\n#SchedulerParameters=", "\nSchedulerParameters="))
    try:
        assert cluster.run("scontrol", "reconfigure").returncode == 0
        cluster.wait_for(lambda: "nohold_on_prolog_fail" in cluster.run("scontrol", "show", "config").stdout, "the new SchedulerParameters")
        cluster.resume()
        cluster.use_root("planted")
        submitted = cluster.run("sbatch", "--parsable", "--gres=gpu:1", "--output=/dev/null", "--wrap", "true")
        job_id = submitted.stdout.strip().split(";")[0]
        cluster.wait_for(lambda: cluster.result_for_job("epilog", job_id) is not None, "the prolog to fail and the epilog to run")
        time.sleep(1)
        shown = cluster.run("scontrol", "show", "job", job_id).stdout
        assert "JobState=PENDING" in shown and "Restarts=1" in shown, shown
        assert "launch_failed_requeued_held" not in shown and "Priority=0 " not in shown, shown
    finally:
        included.write_text(generated)
        cluster.run("scontrol", "reconfigure")
        cluster.run("scancel", "--partition=debug")
        cluster.wait_for(lambda: "nohold_on_prolog_fail" not in cluster.run("scontrol", "show", "config").stdout, "the generated config back")


def test_generated_slurm_conf_lines_are_what_slurmctld_runs(cluster: Cluster) -> None:
    shown = {
        key.strip(): value.strip()
        for key, _, value in (line.partition("=") for line in cluster.run("scontrol", "show", "config").stdout.splitlines())
    }
    assert shown["Prolog"] == f"{cluster.base}/preflight-prolog" and shown["Epilog"] == f"{cluster.base}/preflight-epilog"
    assert shown["PrologFlags"] == "Alloc" and shown["HealthCheckProgram"] == f"{cluster.base}/preflight-healthcheck"
    assert shown["PrologEpilogTimeout"] == f"{int(PROLOG_BUDGET_S) + 2}" and shown["MessageTimeout"] == f"{MESSAGE_TIMEOUT_S} sec"
    assert shown["HealthCheckInterval"] == "3600 sec" and shown["HealthCheckNodeState"] == "ANY"


def test_slurm_conf_is_read_as_slurmctld_reads_it(cluster: Cluster) -> None:
    """preflight's slurm.conf reader against Slurm's own: the relative Include and the continued
    PropagateResourceLimitsExcept line give what `scontrol show config` reports."""
    shown = {
        key.strip(): value.strip()
        for key, _, value in (line.partition("=") for line in cluster.run("scontrol", "show", "config").stdout.splitlines())
    }
    conf = read_slurm_conf(NodeFS("/").read, str(cluster.conf))
    assert conf is not None and conf.unread == ()
    assert shown["PropagateResourceLimitsExcept"] == conf.settings["propagateresourcelimitsexcept"].value == "MEMLOCK,STACK"
    assert propagated(conf, "MEMLOCK") == (False, f"PropagateResourceLimitsExcept=MEMLOCK,STACK ({cluster.base}/limits.conf:2)")
    assert propagated(conf, "STACK")[0] is False and propagated(conf, "NOFILE")[0] is True
    for key in ("ClusterName", "Prolog", "HealthCheckProgram", "SlurmdSpoolDir"):
        assert conf.settings[key.lower()].value == shown[key], key


def test_no_verdict_prolog_lets_the_job_run_and_leaves_a_trace(cluster: Cluster) -> None:
    """A wrong --root and a typo in the config: the job runs, and operators find the reason in
    the last-result file, in syslog at error level and in slurmd.log (the prolog's stderr)."""
    if "DRAIN" in cluster.node()[0]:
        cluster.resume()
    config = cluster.base / "preflight.toml"
    original = config.read_text()
    try:
        for broken, problem in (
            ("missing", f"--root {cluster.base}/root: no such directory"),
            ("typo", "run.probe_timout: unknown key"),
        ):
            if broken == "typo":
                cluster.use_root("clean")
                config.write_text(original.replace("probe_timeout", "probe_timout"))
            else:
                cluster.use_root("missing")
            cluster.syslog_lines()
            job = cluster.run("srun", "-N1", "echo", "ran undecided")
            assert job.returncode == 0 and "ran undecided" in job.stdout, job.stderr + cluster.logs()
            result = cluster.result("prolog")
            assert result["verdict"] == "no-verdict" and result["exit_code"] == 0, result
            assert problem in result["errors"][0], result  # type: ignore[index]
            line = f"preflight: no verdict (prolog): {result['errors'][0]}"  # type: ignore[index]
            assert any(sent.startswith("<27>preflight[") and sent.endswith(line) for sent in cluster.syslog_lines())
            slurmd_log = (cluster.base / "log" / "slurmd.log").read_text(errors="replace")
            assert f"prolog success rc:0 output:{line}" in slurmd_log
    finally:
        config.write_text(original)
        cluster.use_root("clean")


def test_4_healthcheck_resumes_its_own_drain_once_the_root_is_clean(cluster: Cluster) -> None:
    if "DRAIN" not in cluster.node()[0]:
        cluster.run("scontrol", "update", f"NodeName={NODE}", "State=DRAIN", "Reason=preflight: MEM001 (prolog job 1)")
    cluster.use_root("planted")
    still_bad = cluster.healthcheck()
    assert still_bad.returncode == 2, still_bad.stdout + still_bad.stderr
    state, reason = cluster.node()
    assert "DRAIN" in state and reason.startswith("preflight: ") and "(healthcheck)" in reason
    cluster.use_root("clean")
    clean = cluster.healthcheck()
    assert clean.returncode == 0 and "resumed" in clean.stdout, clean.stdout + clean.stderr
    state, reason = cluster.node()
    assert "DRAIN" not in state and reason == "", (state, reason)
    job = cluster.run("srun", "--gres=gpu:1", "-N1", "echo", "back")
    assert job.returncode == 0 and "back" in job.stdout


def test_4_healthcheck_leaves_an_admin_drain_alone(cluster: Cluster) -> None:
    admin = "admin: replacing DIMM B3"
    cluster.run("scontrol", "update", f"NodeName={NODE}", "State=DRAIN", f"Reason={admin}")
    try:
        for root in ("planted", "clean"):
            cluster.use_root(root)
            checked = cluster.healthcheck()
            assert checked.returncode in (0, 2), checked.stderr
            assert "left alone" in checked.stdout or root == "clean", checked.stdout
            state, reason = cluster.node()
            assert "DRAIN" in state and reason == admin, (root, state, reason)
        assert [action["argv"][1] for action in cluster.result("healthcheck")["actions"]] == ["show"]  # type: ignore[index]
    finally:
        cluster.use_root("clean")
        cluster.resume()


def test_4_healthcheck_beside_a_running_job_drains_nothing(cluster: Cluster) -> None:
    """HealthCheckNodeState=ANY runs the health check on allocated nodes too: a job's own
    rendezvous listener and BAR1 mappings are no fault of the node, and must not drain it."""
    cluster.use_root("busy")
    try:
        checked = cluster.healthcheck()
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert "DRAIN" not in cluster.node()[0]
        result = cluster.result("healthcheck")
        findings = {(f["id"], f["subject"]): (f["status"], f["severity"]) for f in result["report"]["findings"]}  # type: ignore[index]
        assert findings[("SOCK001", "port 29500")] == ("present", "warning")
        assert findings[("GDR003", "GPU0")] == ("unknown", "warning")
        assert findings[("NCCL011", "GPU0")] == ("present", "warning")
        assert result["verdict"] == "clean", result["verdict"]
    finally:
        cluster.use_root("clean")


def test_5_hanging_probe_prolog_returns_within_its_deadline_and_the_job_runs(cluster: Cluster) -> None:
    cluster.use_root("hanging")
    # The hung NVML call never returns: the job ran, so the prolog gave up on it within Slurm's
    # PrologEpilogTimeout (cluster.run's subprocess timeout is only a hang guard;
    # bench/deadlines.py times the prolog against its budget).
    job = cluster.run("srun", "--gres=gpu:2", "-N1", "echo", "ran anyway")
    assert job.returncode == 0 and "ran anyway" in job.stdout, job.stderr + cluster.logs()
    result = cluster.result("prolog")
    assert result["verdict"] in ("clean", "undecided") and result["exit_code"] == 0, result
    probes = {probe["name"]: probe for probe in result["report"]["probes"]}  # type: ignore[index]
    assert any(probe["status"] == "timeout" for probe in probes.values()), probes
    unknown = [f["id"] for f in result["report"]["findings"] if f["status"] == "unknown"]  # type: ignore[index]
    assert "GPU001" in unknown
    assert "DRAIN" not in cluster.node()[0]


def test_healthcheck_without_slurm_conf_reads_the_file_slurmd_was_given(cluster: Cluster) -> None:
    """slurmd starts HealthCheckProgram with SLURMD_NODENAME alone; this cluster's slurm.conf is
    not at a default path, so only slurmd's own SLURM_CONF (read from /proc/<slurmd>/environ)
    finds it. A live run on this host, with draining off: the kill time names the file."""
    config = cluster.base / "no-drain.toml"
    config.write_text((cluster.base / "preflight.toml").read_text().replace("[slurm]\n", "[slurm]\ndrain = false\n", 1))
    checked = subprocess.run(
        [*preflight_command(), "slurm", "healthcheck", "--config", str(config), "--timeout", "20"],
        capture_output=True, text=True, timeout=120, env={"SLURMD_NODENAME": NODE},
    )
    assert checked.returncode in (0, 2), checked.stdout + checked.stderr
    kill_time = cluster.result("healthcheck")["kill_time"]
    assert kill_time["seconds"] == 60 and str(cluster.conf) in kill_time["source"], kill_time  # type: ignore[index]
    assert "DRAIN" not in cluster.node()[0]


def test_healthcheck_without_a_reachable_controller_returns_within_its_budget(cluster: Cluster) -> None:
    unreachable = cluster.base / "unreachable.conf"
    unreachable.write_text(cluster.conf.read_text().replace(f"SlurmctldPort={cluster.conf.read_text().split('SlurmctldPort=')[1].split()[0]}", f"SlurmctldPort={free_port()}"))
    cluster.use_root("planted")
    # The subprocess timeout is only a hang guard: the verdict and the recorded action show that
    # the run gave up on the controller.
    checked = subprocess.run(
        [*preflight_command(), "slurm", "healthcheck", "--root", str(cluster.base / "root"), "--config", str(cluster.base / "preflight.toml"), "--timeout", "6"],
        capture_output=True, text=True, timeout=60, env={"SLURMD_NODENAME": NODE, "SLURM_CONF": str(unreachable)},
    )
    cluster.use_root("clean")
    assert checked.returncode == 2 and "left alone" in checked.stdout, checked.stdout + checked.stderr
    actions = cluster.result("healthcheck")["actions"]
    assert [action["status"] for action in actions] in (["timeout"], ["failed"]), actions  # type: ignore[index]
    assert "DRAIN" not in cluster.node()[0]


# -- a read stuck in the kernel ----------------------------------------------------------------

#: Files of the root whose reads never return: two module versions the gpudirect and rdma probes
#: read, and a refcount next to them.
STUCK_FILES = ("mlx5_core/version", "nvidia/version", "ib_uverbs/refcnt")


def fuse_skip_reason() -> str:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is not available here (a container without it): no FUSE mount can be made"
    import ctypes.util

    if ctypes.util.find_library("fuse") is None:
        return "libfuse2 is missing: apt-get install libfuse2 fuse"
    return ""


@pytest.fixture
def stuck_root(cluster: Cluster, tmp_path: Path) -> Iterator[Path]:
    """The clean root with a FUSE file system over sys/module whose reads of STUCK_FILES never
    return (tests/fuse_hang.py); a fresh server per test, unmounted after it."""
    reason = fuse_skip_reason()
    if reason:
        pytest.skip(reason)
    root = tmp_path / "stuck"
    shutil.copytree(cluster.roots["clean"], root, symlinks=True)
    served = tmp_path / "module"
    (root / "sys" / "module").rename(served)
    (root / "sys" / "module").mkdir()
    mountpoint = root / "sys" / "module"
    server = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve().parents[1] / "fuse_hang.py"), str(served), str(mountpoint), *STUCK_FILES],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "fuse.log", "wb"), start_new_session=True,
    )
    try:
        cluster.wait_for(lambda: os.path.ismount(mountpoint) or server.poll() is not None, "the FUSE mount", 15)
        assert os.path.ismount(mountpoint), (tmp_path / "fuse.log").read_text()
        cluster.roots["stuck"] = root
        yield root
    finally:
        cluster.roots.pop("stuck", None)
        server.kill()  # aborts the connection: readers stuck on it get an error and go on
        server.wait(timeout=15)
        subprocess.run(["fusermount", "-u", "-z", str(mountpoint)], capture_output=True, timeout=15, check=False)


def test_6_a_read_stuck_in_the_kernel_cannot_hold_the_prolog(cluster: Cluster, stuck_root: Path) -> None:
    """Reads that never return hold only the child process the probes run in: the prolog reports
    on its deadline, exits, and slurmd starts the job. The first job's prolog leaves a read in
    flight, and the FUSE request keeps the file's page locked until the server answers (never);
    every later open of the file then waits for that page lock in uninterruptible sleep, where no
    signal reaches it. Before, that thread was the prolog's own, the prolog's process could not
    exit, and slurmd waited on it past PrologEpilogTimeout. (cluster.run's timeout is only a hang
    guard; bench/deadlines.py times the prolog.)"""
    cluster.use_root("stuck")
    for attempt in ("first", "second"):
        job = cluster.run("srun", "--gres=gpu:2", "-N1", "echo", f"{attempt} ran anyway", timeout=60)
        assert job.returncode == 0 and f"{attempt} ran anyway" in job.stdout, attempt + job.stderr + cluster.logs()
    result = cluster.result("prolog")
    probes = {probe["name"]: probe["status"] for probe in result["report"]["probes"]}  # type: ignore[index]
    assert probes["gpudirect"] == "timeout" and probes["rdma"] == "timeout", probes
    assert result["exit_code"] == 0 and "DRAIN" not in cluster.node()[0]
    # What the prolog left behind, if anything, keeps nobody waiting: a process of its own
    # session, with nothing of slurmd's (no pipe) among its standard streams.
    for pid in [entry for entry in os.listdir("/proc") if entry.isdigit()]:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
            streams = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in (0, 1, 2)]
            session = os.getsid(int(pid))
        except OSError:
            continue
        arguments = command.split(b"\0")
        if str(cluster.base).encode() in command and b"slurm" in arguments and b"prolog" in arguments:
            assert session == int(pid) and streams == [os.devnull] * 3, (pid, command, streams)


def _state(task: Path) -> str:
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _command(process: Path) -> bytes:
    try:
        return (process / "cmdline").read_bytes()
    except OSError:
        return b""
