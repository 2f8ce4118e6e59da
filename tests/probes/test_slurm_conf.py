"""slurm.conf read as Slurm reads it (preflight/slurm_conf.py, after Slurm's parse_config.c):
continuations, escaped and unescaped comments, one key per line in any case, quoted values, the
last assignment winning, Include files (relative, %c, globs skipped, unread ones undecided), and
the configless copy slurmd keeps under /run/slurm/conf; and slurmd's systemd unit with its
drop-ins, read as systemd reads them."""

from __future__ import annotations

import json
from pathlib import Path

from preflight.checks.mem import memlock_limit_too_low
from preflight.config import Expectations
from preflight.model import Status
from preflight.probes.job import probe_job
from preflight.probes.memlock import probe_memlock
from preflight.probes.nccl_platform import probe_nccl_platform
from preflight.slurm_conf import (
    DEFAULT_PROPAGATION,
    MAX_FILES,
    MAX_UNREAD,
    find_slurm_conf,
    gpus_as_gres,
    logical_lines,
    propagated,
    read_slurm_conf,
    script_kill_time,
    slurmd_conf_option,
)
from preflight.sources import NodeFS
from preflight.sources.fs import SourceError

CONF = "/etc/slurm/slurm.conf"


def reader(files: dict[str, str]):  # type: ignore[no-untyped-def]
    def read(path: str) -> str | None:
        text = files.get(path)
        if text == "<unreadable>":
            raise SourceError(path, "permission denied (EACCES); needs root")
        return text

    return read


def memlock(files: dict[str, str]) -> tuple[bool | None, str]:
    conf = read_slurm_conf(reader(files), CONF)
    assert conf is not None
    return propagated(conf, "MEMLOCK")


def test_script_kill_times_are_read_as_slurmd_reads_them() -> None:
    """HealthCheckTimeout (Slurm 26.05), PrologTimeout/EpilogTimeout (25.05) before
    PrologEpilogTimeout: strtoul with base 0, UNLIMITED as 65535, anything Slurm refuses read as the
    default; 0 resets a health check's to 60 s and lifts a prolog's limit; an Include that cannot be
    read leaves the default, said to be assumed."""
    def kill(mode: str, text: str | None, **extra: str) -> tuple[int | None, str]:
        files = {CONF: text} if text is not None else {}
        return tuple(script_kill_time(find_slurm_conf(reader({**files, **extra})), mode))  # type: ignore[return-value]

    assert kill("healthcheck", "ClusterName=c\nhealthchecktimeout=20\n") == (20, f"healthchecktimeout=20 ({CONF}:2)")
    assert kill("healthcheck", "HealthCheckTimeout=0x3c\n")[0] == 60 and kill("healthcheck", "HealthCheckTimeout=036\n")[0] == 30
    assert kill("healthcheck", "HealthCheckTimeout=UNLIMITED\n")[0] == 65535
    assert kill("healthcheck", "HealthCheckTimeout=+90\n")[0] == 90
    for refused in ("0", "-5", "70000", "20s", "08", '""'):
        seconds, source = kill("healthcheck", f"HealthCheckTimeout={refused}\n")
        assert seconds == 60 and source.endswith("is not a limit slurmd keeps: Slurm's default (60 s)"), refused
    assert kill("healthcheck", "ClusterName=c\n") == (60, f"HealthCheckTimeout not set in {CONF}: Slurm's default (60 s)")
    seconds, source = kill("healthcheck", "Include extra.conf\n", **{"/etc/slurm/extra.conf": "<unreadable>"})
    assert seconds == 60 and source.endswith("it may set HealthCheckTimeout: Slurm's default (60 s) assumed")
    assert kill("healthcheck", None) == (60, "no slurm.conf found: Slurm's default (60 s) assumed")
    seconds, source = kill("healthcheck", None, **{CONF: "<unreadable>"})
    assert seconds == 60 and "permission denied" in source

    both = "PrologEpilogTimeout=30\nEpilogTimeout=90\n"
    assert kill("prolog", both) == (30, f"PrologEpilogTimeout=30 ({CONF}:1)")
    assert kill("epilog", both) == (90, f"EpilogTimeout=90 ({CONF}:2)")
    assert kill("prolog", "PrologTimeout=5\n" + both)[0] == 5
    assert kill("prolog", "PrologEpilogTimeout=0\n") == (None, f"PrologEpilogTimeout=0 ({CONF}:1): no limit")
    assert kill("epilog", "ClusterName=c\n") == (
        None, f"neither EpilogTimeout nor PrologEpilogTimeout set in {CONF}: Slurm's default (no limit)"
    )
    seconds, source = kill("prolog", "Include extra.conf\n", **{"/etc/slurm/extra.conf": "<unreadable>"})
    assert seconds is None and source.endswith("it may set PrologTimeout or PrologEpilogTimeout: Slurm's default (no limit) assumed")


def test_gpus_as_gres_only_where_gres_types_names_gpu() -> None:
    """Slurm drops a node's Gres=gpu unless GresTypes names gpu (gres_name_filter), and sets
    SLURM_JOB_GPUS only for GPUs given as GRES."""
    def gres(files: dict[str, str]) -> tuple[bool | None, str]:
        return gpus_as_gres(find_slurm_conf(reader(files)))

    assert gres({CONF: "GresTypes=mps,gpu,shard\n"}) == (True, f"GresTypes=mps,gpu,shard ({CONF}:1)")
    assert gres({CONF: "GresTypes=nic\nNodeName=n[1-4] Gres=gpu:4\n"})[0] is False
    assert gres({CONF: "ClusterName=c\n"}) == (False, f"GresTypes not set in {CONF}")
    assert gres({CONF: "Include gres.conf.d\n"})[0] is None
    assert gres({}) == (None, "no slurm.conf found")


def test_lines_are_joined_stripped_and_unescaped_as_slurm_does() -> None:
    text = "A=1 \\\n  B=2\n# whole comment\nC=x\\#y # trailing\nD=a\\\\\n\n   \nE=\"two words\"\n"
    assert list(logical_lines(text)) == [(1, "A=1   B=2"), (4, "C=x#y "), (5, "D=a\\"), (8, 'E="two words"')]
    conf = read_slurm_conf(reader({CONF: text}), CONF)
    assert conf is not None and conf.settings["e"].value == "two words" and conf.settings["c"].value == "x#y"


def test_keys_ignore_case_and_the_last_assignment_wins() -> None:
    assert memlock({CONF: "propagateresourcelimitsEXCEPT=memlock\n"}) == (False, "propagateresourcelimitsEXCEPT=memlock")
    assert memlock({CONF: "PropagateResourceLimits=NONE\nPropagateResourceLimits=ALL\n"})[0] is True
    assert memlock({CONF: "PropagateResourceLimitsExcept=MEMLOCK,\\\nSTACK\n"}) == (False, "PropagateResourceLimitsExcept=MEMLOCK,STACK")
    assert memlock({CONF: "ClusterName=a\n"}) == (True, DEFAULT_PROPAGATION)


def test_include_files_are_read_in_place() -> None:
    files = {
        CONF: "ClusterName=Alpha\nInclude limits.conf\nINCLUDE /etc/slurm/%c/nodes.conf\ninclude /etc/slurm/parts/*.conf\n",
        "/etc/slurm/limits.conf": "PropagateResourceLimitsExcept=MEMLOCK\n",
        "/etc/slurm/alpha/nodes.conf": "NodeName=n[1-4] CPUs=8\n",
    }
    assert memlock(files) == (False, "PropagateResourceLimitsExcept=MEMLOCK (/etc/slurm/limits.conf:1)")
    conf = read_slurm_conf(reader(files), CONF)
    assert conf is not None and conf.settings["nodename"].where == "/etc/slurm/alpha/nodes.conf:1" and conf.unread == ()
    # a setting after the Include overrides it, as in Slurm
    files[CONF] += "PropagateResourceLimitsExcept=NOFILE\n"
    assert memlock(files)[0] is True


def test_an_include_that_cannot_be_read_leaves_propagation_undecided() -> None:
    for included in (None, "<unreadable>"):
        files = {CONF: "PropagateResourceLimitsExcept=MEMLOCK\nInclude /etc/slurm/site.conf\n"}
        if included is not None:
            files["/etc/slurm/site.conf"] = included
        decided, why = memlock(files)
        assert decided is None and "Include /etc/slurm/site.conf" in why and f"{CONF}:2" in why
    decided, why = memlock({CONF: "Include %c.conf\n"})
    assert decided is None and "no ClusterName" in why


def test_include_loops_stop() -> None:
    decided, why = memlock({CONF: "Include slurm.conf\n"})
    assert decided is None and f"more than {MAX_FILES} files" in why
    conf = read_slurm_conf(reader({CONF: "Include missing.conf\n" * 100_000}), CONF)
    assert conf is not None and len(conf.unread) == MAX_UNREAD


def test_the_slurm_conf_slurm_would_read(tmp_path: Path) -> None:
    """$SLURM_CONF first, then the copy slurmd keeps in configless mode (made only when slurmd
    fetched its configuration, which it then uses whatever /etc/slurm holds), then /etc/slurm."""
    files = {"/run/slurm/conf/slurm.conf": "PropagateResourceLimitsExcept=MEMLOCK\n"}
    conf, problems = find_slurm_conf(reader(files))
    assert conf is not None and conf.path == "/run/slurm/conf/slurm.conf" and problems == []
    files[CONF] = "PropagateResourceLimits=ALL\n"  # left over from before the cluster went configless
    conf, _ = find_slurm_conf(reader(files))
    assert conf is not None and conf.path == "/run/slurm/conf/slurm.conf"
    conf, _ = find_slurm_conf(reader({CONF: "PropagateResourceLimits=ALL\n"}))
    assert conf is not None and conf.path == CONF
    files["/srv/job.conf"] = "PropagateResourceLimits=ALL\n"
    conf, _ = find_slurm_conf(reader(files), "/srv/job.conf")
    assert conf is not None and conf.path == "/srv/job.conf"
    conf, problems = find_slurm_conf(reader({CONF: "<unreadable>"}))
    assert conf is None and problems and "needs root" in problems[0]


def test_probes_read_includes_and_the_configless_copy_inside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "node"
    (root / "etc" / "slurm").mkdir(parents=True)
    (root / "proc").mkdir()
    (root / "etc" / "slurm" / "slurm.conf").write_text("ClusterName=c\nInclude limits.conf\n")
    (root / "etc" / "slurm" / "limits.conf").write_text("PropagateResourceLimitsExcept=MEMLOCK,STACK\n")
    facts = probe_memlock(NodeFS(str(root)))
    assert facts.memlock_propagated is False and "limits.conf:1" in facts.propagation_setting
    platform = probe_nccl_platform(NodeFS(str(root)))
    assert platform.stack_propagated is False and platform.slurm_conf == CONF
    # configless: no /etc/slurm/slurm.conf, slurmd's cached copy behind /run/slurm/conf
    (root / "etc" / "slurm" / "slurm.conf").unlink()
    cache = root / "var" / "spool" / "slurmd" / "conf-cache"
    cache.mkdir(parents=True)
    (cache / "slurm.conf").write_text("PropagateResourceLimits=ALL\n")
    (root / "run" / "slurm").mkdir(parents=True)
    (root / "run" / "slurm" / "conf").symlink_to("/var/spool/slurmd/conf-cache")
    facts = probe_memlock(NodeFS(str(root)))
    assert facts.slurm_conf == "/run/slurm/conf/slurm.conf" and facts.memlock_propagated is True
    # an include that escapes the root stays inside it (NodeFS resolves it there)
    (cache / "slurm.conf").write_text("Include ../../../../../../etc/passwd\n")
    facts = probe_memlock(NodeFS(str(root)))
    assert facts.memlock_propagated is None and "is not there" in facts.propagation_setting


def test_slurmd_unit_drop_ins_apply_as_systemd_applies_them(tmp_path: Path) -> None:
    """slurmd's LimitMEMLOCK from its unit and drop-ins (systemd.unit(5)): drop-ins apply in file
    name order across the unit directories, a name in /etc hides the same name in /usr/lib, and
    an empty assignment resets the limit to the manager's default."""
    root = tmp_path / "node"
    unit = root / "usr/lib/systemd/system"
    unit.mkdir(parents=True)
    (root / "proc").mkdir()
    (unit / "slurmd.service").write_text("[Unit]\nDescription=Slurm node daemon\n[Service]\nLimitMEMLOCK=infinity\n")
    (unit / "slurmd.service.d").mkdir()
    (unit / "slurmd.service.d" / "50-site.conf").write_text("[Service]\nLimitMEMLOCK=8M\n")
    etc = root / "etc/systemd/system/slurmd.service.d"
    etc.mkdir(parents=True)
    facts = probe_memlock(NodeFS(str(root)))
    assert facts.slurmd_unit_limit is not None and facts.slurmd_unit_limit.soft == 8 << 20  # the drop-in after the unit
    (etc / "50-site.conf").write_text("[Service]\nLimitMEMLOCK=infinity\n")  # same name in /etc hides /usr/lib's
    facts = probe_memlock(NodeFS(str(root)))
    assert facts.slurmd_unit_limit is not None and facts.slurmd_unit_limit.source == "/etc/systemd/system/slurmd.service.d/50-site.conf"
    (etc / "90-reset.conf").write_text("[Service]\nLimitMEMLOCK=\n")  # later by name: the reset wins
    assert probe_memlock(NodeFS(str(root))).slurmd_unit_limit is None


def test_slurmd_dash_f_is_read_as_getopt_reads_it() -> None:
    """slurmd's getopt string "bcCd:Df:F::GhL:Mn:N:svVZ": -f takes the next word or the rest of
    its own; another option's value is never taken for it; the last -f wins."""
    def cmdline(*args: str) -> bytes:
        return "\0".join(("/usr/sbin/slurmd", *args)).encode() + b"\0"

    assert slurmd_conf_option(cmdline("-D", "-s")) is None
    assert slurmd_conf_option(cmdline("-f", "/cm/slurm.conf")) == "/cm/slurm.conf"
    assert slurmd_conf_option(cmdline("-f/opt/a.conf")) == "/opt/a.conf"
    assert slurmd_conf_option(cmdline("-Df", "/opt/b.conf", "-vvv")) == "/opt/b.conf"
    assert slurmd_conf_option(cmdline("-N", "-f", "-D")) is None  # "-f" is -N's node name
    assert slurmd_conf_option(cmdline("--conf-server", "-f", "-D")) is None
    assert slurmd_conf_option(cmdline("--conf-server=h", "-f", "/x", "-f", "/y")) == "/y"
    assert slurmd_conf_option(cmdline("-Fgpu", "-f", "/z")) == "/z"  # F's value is attached only
    assert slurmd_conf_option(b"\xff\xfe") is None


def _slurmd_node(root: Path, environ: str | None, cmdline: str = "/usr/sbin/slurmd\0-D\0") -> NodeFS:
    """A node whose root-owned slurmd (pid 4242) has ``environ``, and one RDMA device; no
    SLURM_CONF in preflight's own environment (a health check, cron, an operator's shell)."""
    slurmd = root / "proc" / "4242"
    slurmd.mkdir(parents=True, exist_ok=True)
    (slurmd / "comm").write_text("slurmd\n")
    (slurmd / "status").write_text("Name:\tslurmd\nUid:\t0\t0\t0\t0\n")
    (slurmd / "cmdline").write_bytes(cmdline.encode())
    (slurmd / "limits").write_text("Limit Soft Limit Hard Limit Units\nMax locked memory unlimited unlimited bytes\n")
    if environ is not None:
        (slurmd / "environ").write_bytes(environ.encode())
    (root / "proc" / "self").mkdir(exist_ok=True)
    (root / "proc" / "self" / "environ").write_bytes(b"SLURMD_NODENAME=node001\0")
    (root / "proc" / "self" / "limits").write_text("Limit Soft Limit Hard Limit Units\nMax locked memory unlimited unlimited bytes\n")
    (root / "sys" / "class" / "infiniband" / "mlx5_0").mkdir(parents=True, exist_ok=True)
    (root / "etc" / "security").mkdir(parents=True, exist_ok=True)
    return NodeFS(str(root))


def _slurm_conf_finding(fs: NodeFS) -> tuple[str, str]:
    findings = {o.subject: o for o in memlock_limit_too_low(probe_memlock(fs), probe_job(fs), Expectations())}
    found = findings.get("slurm.conf")
    return ("", "") if found is None else (found.status.value, found.reason or " ".join(e.observed for e in found.evidence))


def test_without_slurm_conf_in_its_environment_the_file_is_the_one_slurmd_reads(tmp_path: Path) -> None:
    """Base Command Manager keeps slurm.conf under /cm/shared and names it in slurmd's unit
    (Environment=SLURM_CONF=...); a health check gets SLURMD_NODENAME alone (slurmd.c). The file
    slurmd was told decides, never a left-over /etc/slurm/slurm.conf."""
    bcm = "/cm/shared/apps/slurm/var/etc/slurm/slurm.conf"
    fs = _slurmd_node(tmp_path, f"PATH=/usr/bin\0SLURM_CONF={bcm}\0")
    (tmp_path / bcm.lstrip("/")).parent.mkdir(parents=True)
    (tmp_path / bcm.lstrip("/")).write_text("ClusterName=slurm\n")  # PropagateResourceLimits unset: ALL
    (tmp_path / "etc" / "slurm").mkdir()
    (tmp_path / "etc" / "slurm" / "slurm.conf").write_text("PropagateResourceLimitsExcept=MEMLOCK\n")
    facts = probe_memlock(fs)
    assert facts.slurm_conf == bcm and facts.memlock_propagated is True
    status, shown = _slurm_conf_finding(fs)
    assert status == Status.PRESENT.value and "MEMLOCK propagated" in shown
    assert probe_nccl_platform(fs).slurm_conf == bcm
    # -f comes before SLURM_CONF (slurmd.c, _slurm_conf_file_exists)
    fs = _slurmd_node(tmp_path, f"SLURM_CONF={bcm}\0", "/cm/local/apps/slurm/current/sbin/slurmd\0-f\0/etc/slurm/slurm.conf\0")
    assert probe_memlock(fs).memlock_propagated is False
    # the file slurmd was told is not there: unknown, not the default path's answer
    fs = _slurmd_node(tmp_path, "SLURM_CONF=/cm/shared/missing.conf\0")
    status, shown = _slurm_conf_finding(fs)
    assert status == Status.UNKNOWN.value and "/cm/shared/missing.conf" in shown and "not there" in shown


def test_slurmd_running_with_no_slurm_conf_found_is_unknown(tmp_path: Path) -> None:
    """slurmd reads some file (a compiled-in default, /usr/local/etc/slurm.conf for a source
    build): with none found, MEM001's slurm.conf subject is unknown, never silently absent."""
    fs = _slurmd_node(tmp_path, "PATH=/usr/bin\0")
    status, shown = _slurm_conf_finding(fs)
    assert status == Status.UNKNOWN.value and "slurmd (pid 4242) runs" in shown
    # its environment unread (not root): the reason says so
    (tmp_path / ".preflight").mkdir()
    (tmp_path / ".preflight" / "read-errors.json").write_text(
        json.dumps({"format": "preflight-read-errors/1", "errors": {"/proc/4242/environ": "EACCES"}})
    )
    status, shown = _slurm_conf_finding(NodeFS(str(tmp_path)))
    assert status == Status.UNKNOWN.value and "environment" in shown and "unread" in shown
    # no slurmd: nothing to read, nothing to judge
    (tmp_path / "proc" / "4242" / "comm").write_text("bash\n")
    assert _slurm_conf_finding(NodeFS(str(tmp_path))) == ("", "")


def test_slurmds_pid_file_is_read_once_where_var_run_is_run(tmp_path: Path) -> None:
    """/var/run links to /run on current distributions: a pid whose process cannot be read is one
    problem (one unknown MEM001 finding), not one per name of the same file."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "slurmd.pid").write_text("4242\n")
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "run").symlink_to("/run")
    (tmp_path / "proc" / "4242").mkdir(parents=True)
    (tmp_path / "proc" / "4242" / "comm").write_text("slurmd\n")
    (tmp_path / ".preflight").mkdir()
    (tmp_path / ".preflight" / "read-errors.json").write_text(
        json.dumps({"format": "preflight-read-errors/1", "errors": {"/proc/4242/comm": "EACCES"}})
    )
    problems = [p for p in probe_memlock(NodeFS(str(tmp_path))).problems if "/proc/4242/comm" in p]
    assert len(problems) == 1, problems
