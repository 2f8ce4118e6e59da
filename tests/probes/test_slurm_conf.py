"""slurm.conf read as Slurm reads it (preflight/slurm_conf.py, after Slurm's parse_config.c):
continuations, escaped and unescaped comments, one key per line in any case, quoted values, the
last assignment winning, Include files (relative, %c, globs skipped, unread ones undecided), and
the configless copy slurmd keeps under /run/slurm/conf; and slurmd's systemd unit with its
drop-ins, read as systemd reads them."""

from __future__ import annotations

from pathlib import Path

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
