"""The engine under stress: hung sources, failing probes, registration mistakes, plugins."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import msgspec.structs
import pytest
from conftest import Runner, site_config, write

from preflight.discovery import build_registry, directory_modules
from preflight.registry import RegistrationError, Registry, check, probe
from preflight.sources import Clock


def _hang_nvml(root: Path) -> None:
    nvml = json.loads((root / ".preflight/nvml.json").read_text())
    nvml["calls"]["nvmlDeviceGetCount"] = {"hang": True}
    write(root, "/.preflight/nvml.json", json.dumps(nvml))


def test_blocking_nvml_becomes_unknown_within_deadline(run_cli: Runner, node_copy: Path) -> None:
    _hang_nvml(node_copy)
    config = site_config(node_copy, "[run]\nprobe_timeout = 1.0\n")
    # The replayed call never returns: a report at all means the engine stopped waiting for it
    # (run_cli's subprocess timeout is only a hang guard; bench/deadlines.py times this run).
    result = run_cli("node", "--root", str(node_copy), "--config", config, "--format", "json", "--timeout", "2")
    report = json.loads(result.stdout)
    gpu = [f for f in report["findings"] if f["id"] == "GPU001"]
    assert gpu[0]["status"] == "unknown" and gpu[0]["reason"].startswith("probe gpus: timed out after"), gpu[0]
    # The other NVML references wait for the same stuck library (ROCE002 reads NVLink state, for
    # NCCL's PXN relay; GDR002 the CUDA version the driver supports, which NCCL 2.31.2+'s own
    # DMA-BUF mapping needs); every other reference is still decided.
    nvml_references = {"GPU001", "GPU002", "GDR002", "GDR003", "NCCL011", "NVL001", "NVL002", "NVL003", "NVL004", "NVL006", "PCI004", "PCI005", "ROCE002"}
    assert {f["status"] for f in report["findings"] if f["id"] in nvml_references} == {"unknown"}
    assert {f["status"] for f in report["findings"] if f["id"] not in nvml_references} <= {"present", "absent", "not_applicable"}


def test_global_deadline_bounds_the_run(run_cli: Runner, node_copy: Path) -> None:
    _hang_nvml(node_copy)
    # The probe may wait ten minutes, the run 1.5 s: only the run's deadline can end it before
    # run_cli's subprocess timeout, a hang guard here (bench/deadlines.py times this run).
    config = site_config(node_copy, "[run]\nprobe_timeout = 600\n")
    result = run_cli("node", "--root", str(node_copy), "--config", config, "--format", "json", "--timeout", "1.5")
    report = json.loads(result.stdout)
    gpus = next(p for p in report["probes"] if p["name"] == "gpus")
    assert gpus["status"] == "timeout" and gpus["error"].startswith("timed out after"), gpus


@pytest.fixture
def silent_dns_server() -> tuple[str, int]:
    """A real UDP server on loopback that receives queries and never answers."""
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("127.0.0.77", 0))
    stop = threading.Event()

    def swallow() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                server.recvfrom(4096)
            except OSError:
                continue

    thread = threading.Thread(target=swallow, daemon=True)
    thread.start()
    yield server.getsockname()
    stop.set()
    thread.join()
    server.close()


def test_dns_server_that_never_answers(run_cli: Runner, node_copy: Path, silent_dns_server: tuple[str, int]) -> None:
    address, port = silent_dns_server
    hosts = (node_copy / "etc/hosts").read_text().replace("gpu017", "otherhost")
    write(node_copy, "/etc/hosts", hosts)  # force a DNS query for this host's name
    (node_copy / ".preflight/dns.json").unlink()
    config = f'[run]\nprobe_timeout = 1.0\n\n[dns]\nnameservers = ["{address}"]\nport = {port}\nlifetime = 600\n'
    given = site_config(node_copy, config)
    # The resolver and the run would wait ten minutes: only the probe's timeout can end the run
    # before run_cli's subprocess timeout, a hang guard here (bench/deadlines.py times this run).
    result = run_cli("node", "--root", str(node_copy), "--config", given, "--format", "json", "--select", "DNS", "--timeout", "600")
    finding = json.loads(result.stdout)["findings"][0]
    assert finding["status"] == "unknown" and finding["reason"].startswith("probe hostname: timed out after"), finding


def test_dns_lifetime_shorter_than_deadline_reports_timeout(run_cli: Runner, node_copy: Path, silent_dns_server: tuple[str, int]) -> None:
    address, port = silent_dns_server
    write(node_copy, "/etc/hosts", "127.0.0.1 localhost\n")
    (node_copy / ".preflight/dns.json").unlink()
    config = site_config(node_copy, f'[dns]\nnameservers = ["{address}"]\nport = {port}\nlifetime = 0.3\n')
    report = json.loads(run_cli("node", "--root", str(node_copy), "--config", config, "--format", "json", "--select", "DNS001").stdout)
    finding = report["findings"][0]
    assert finding["status"] == "unknown" and "TIMEOUT" in finding["reason"]


def site_directory(tmp_path: Path, source: str) -> Path:
    """A --checks-dir holding one module with ``source``."""
    directory = tmp_path / "checks.d"
    directory.mkdir()
    (directory / "site.py").write_text(textwrap.dedent(source))
    return directory


def registry_of(*functions: object, symbols: dict[str, str]) -> Registry:
    """A validated registry of decorated probe and check functions."""
    registry = Registry()
    for function in functions:
        if hasattr(function, "__preflight_probe__"):
            registry.add_probe(function.__preflight_probe__)
        if hasattr(function, "__preflight_check__"):
            registry.add_check(function.__preflight_check__)
    registry.validate(symbols)
    return registry


def test_duplicate_probe_from_site_dir_is_rejected(run_cli: Runner, example_root: Path, tmp_path: Path) -> None:
    plugin = site_directory(tmp_path, '''
        from preflight.registry import probe

        @probe("memlock")
        def probe_memlock_override(fs):
            raise RuntimeError("boom")
    ''')
    result = run_cli("node", "--root", str(example_root), "--checks-dir", str(plugin))
    assert result.returncode == 3 and "probe memlock is defined twice" in result.stderr


def test_check_directories_others_can_write_are_refused(run_cli: Runner, example_root: Path, tmp_path: Path) -> None:
    """preflight runs as root before every job: a check module anyone could change, or one that
    belongs to another user, would run as root. Both are refused before anything is imported."""
    marker = tmp_path / "imported"
    plugin = site_directory(tmp_path, f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    plugin.chmod(0o777)
    result = run_cli("node", "--root", str(example_root), "--checks-dir", str(plugin))
    assert result.returncode == 3 and "writable by its group or by everyone" in result.stderr
    plugin.chmod(0o755)
    (plugin / "site.py").chmod(0o666)
    result = run_cli("node", "--root", str(example_root), "--checks-dir", str(plugin))
    assert result.returncode == 3 and "writable by its group or by everyone" in result.stderr
    if os.geteuid() == 0:
        (plugin / "site.py").chmod(0o644)
        os.chown(plugin / "site.py", 12345, 12345)
        result = run_cli("node", "--root", str(example_root), "--checks-dir", str(plugin))
        assert result.returncode == 3 and "owned by uid 12345" in result.stderr
    assert not marker.exists()


def test_probe_that_raises_makes_its_references_unknown(example_root: Path) -> None:
    from preflight.config import HostConfig
    from preflight.engine import RunOptions, run
    from preflight.sources import Sources

    @probe("wedged")
    def probe_wedged(fs):  # type: ignore[no-untyped-def]
        raise OSError("device wedged")

    @check("GPU001")
    def gpu_unusable_by_driver(wedged):  # type: ignore[no-untyped-def]
        return []

    registry = registry_of(probe_wedged, gpu_unusable_by_driver, symbols={"GPU001": "gpu-unusable-by-driver"})
    report = run(registry, Sources.for_node(str(example_root)), HostConfig(), RunOptions(), "gpu017")
    (finding,) = report.findings
    assert finding.status.value == "unknown" and finding.reason == "probe wedged: OSError: device wedged"
    assert report.probes[0].status == "error"


def test_an_optional_probe_that_fails_reaches_the_check_as_unread(example_root: Path) -> None:
    """A check declaring a probe optional still runs when that probe fails: it gets an Unread
    naming the probe and its error, judges what it can, and says what it cannot."""
    from preflight.config import HostConfig
    from preflight.engine import RunOptions, run
    from preflight.model import Evidence, Unread, present, undecided
    from preflight.sources import Sources

    @probe("wedged")
    def probe_wedged(fs):  # type: ignore[no-untyped-def]
        raise OSError("device wedged")

    @probe("steady")
    def probe_steady(fs):  # type: ignore[no-untyped-def]
        return 8

    @check("GPU001", optional=("wedged",))
    def gpu_unusable_by_driver(steady, wedged):  # type: ignore[no-untyped-def]
        assert isinstance(wedged, Unread)
        yield present("GPU0", Evidence("steady", str(steady)))
        yield undecided("GPU1", str(wedged))

    registry = registry_of(probe_wedged, probe_steady, gpu_unusable_by_driver, symbols={"GPU001": "gpu-unusable-by-driver"})
    report = run(registry, Sources.for_node(str(example_root)), HostConfig(), RunOptions(), "gpu017")
    assert [(f.subject, f.status.value, f.reason) for f in report.findings] == [
        ("GPU0", "present", ""), ("GPU1", "unknown", "probe wedged: OSError: device wedged"),
    ]


def test_an_optional_name_that_is_not_a_probe_parameter_is_refused() -> None:
    with pytest.raises(RegistrationError, match=r"optional \['jobs'\] are not among its probe parameters"):
        @check("GPU001", optional=("jobs",))
        def gpu_unusable_by_driver(job):  # type: ignore[no-untyped-def]
            return []


def test_site_checks_dir_cannot_redefine_a_builtin_check(run_cli: Runner, example_root: Path, tmp_path: Path) -> None:
    site = site_directory(tmp_path, '''
        from preflight.registry import check, probe

        @probe("flaky")
        def probe_flaky(fs):
            raise OSError("device wedged")

        @check("GPU001")
        def gpu_unusable_by_driver(flaky):
            return []
    ''')
    result = run_cli("node", "--root", str(example_root), "--checks-dir", str(site))
    assert result.returncode == 3 and "check GPU001 is defined twice" in result.stderr


def test_registration_errors_are_loud() -> None:
    with pytest.raises(RegistrationError, match="neither sources .* nor probes"):
        registry_of(probe("x")(lambda sockets: None), symbols={})
    with pytest.raises(RegistrationError, match="cannot need itself"):
        probe("selfish")(lambda selfish: None)
    with pytest.raises(RegistrationError, match="AREA"):
        check("mem1")
    with pytest.raises(RegistrationError, match=r"\*args"):
        check("MEM001")(lambda *facts: [])
    with pytest.raises(RegistrationError, match=r"\*\*kwargs"):
        check("MEM001")(lambda **facts: [])
    with pytest.raises(RegistrationError, match="positional-only"):
        probe("positional")(lambda fs, /: None)
    with pytest.raises(RegistrationError, match="not a Python function"):
        probe("callable_object")(type("Probe", (), {"__call__": lambda self, fs: None})())

    @check("ZZZ999")
    def nothing_here(memlock):  # type: ignore[no-untyped-def]
        return []

    with pytest.raises(RegistrationError, match="no reference ZZZ999"):
        registry_of(nothing_here, symbols={})

    @check("MEM001")
    def misnamed(unknown_probe):  # type: ignore[no-untyped-def]
        return []

    with pytest.raises(RegistrationError, match="must be named memlock_limit_too_low.*name no probe"):
        registry_of(misnamed, symbols={"MEM001": "memlock-limit-too-low"})


def test_a_wrapped_probe_is_called_with_the_wrapped_functions_parameters() -> None:
    import functools

    def traced(func):  # type: ignore[no-untyped-def]
        @functools.wraps(func)
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            return func(*args, **kwargs)
        return wrapper

    @probe("wrapped_probe")
    @traced
    def wrapped_probe(fs, nvml):  # type: ignore[no-untyped-def]
        return None

    from preflight.registry import _parameters

    assert _parameters(wrapped_probe, "probe") == ["fs", "nvml"]


def test_entry_point_plugin_is_discovered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A distribution that declares ``preflight.checks`` entry points is loaded and validated."""
    (tmp_path / "acme_checks.py").write_text(textwrap.dedent('''
        from preflight.registry import probe

        @probe("acme_inventory", gather_in=("full",))
        def probe_acme_inventory(fs):
            return {"racks": 1}
    '''))
    dist = tmp_path / "acme_checks-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-checks\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[preflight.checks]\nacme = acme_checks\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = build_registry()
    assert "acme_inventory" in registry.probes
    (dist / "entry_points.txt").write_text("[preflight.checks]\nacme = acme_missing_module\n")
    with pytest.raises(RegistrationError, match="plugin acme"):
        build_registry()
    sys.modules.pop("acme_checks", None)


def test_checks_dir_import_error_is_reported(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text("import does_not_exist\n")
    with pytest.raises(RegistrationError, match="bad.py failed to import"):
        directory_modules(str(tmp_path))
    with pytest.raises(RegistrationError, match="checks-dir"):
        directory_modules(str(tmp_path / "missing"))


def test_many_runs_in_one_process_do_not_leak_threads(example_root: Path) -> None:
    from preflight.config import HostConfig
    from preflight.engine import RunOptions, run
    from preflight.sources import Sources

    registry = build_registry()
    before = threading.active_count()
    for _ in range(30):
        report = run(registry, Sources.for_node(str(example_root)), HostConfig(), RunOptions(), "gpu017")
        assert len(report.findings) >= 6
    assert threading.active_count() <= before + 1


def test_modules_a_prolog_run_skips_have_nothing_for_the_prolog() -> None:
    """discovery.FULL_ONLY_MODULES must only list modules whose checks and gathered probes are
    all full-profile, and whose probes no prolog check needs, directly or through another probe;
    otherwise a prolog would silently lose a check."""
    from preflight.discovery import FULL_ONLY_MODULES, build_registry

    full = build_registry(profile="full")
    prolog = build_registry(profile="prolog")
    assert set(prolog.checks) == {ref_id for ref_id, spec in full.checks.items() if "prolog" in spec.profiles}
    for ref_id, spec in full.checks.items():
        if spec.origin in FULL_ONLY_MODULES:
            assert "prolog" not in spec.profiles, f"{ref_id} runs in the prolog but {spec.origin} is skipped there"
    gathered = {name for name, spec in full.probes.items() if "prolog" in spec.gather_in}
    prolog_needs = full.needed_probes({name for spec in prolog.checks.values() for name in spec.probes} | gathered)
    for name in prolog_needs:
        assert full.probes[name].origin not in FULL_ONLY_MODULES, name
        assert name in prolog.probes, name
    assert set(full.checks) - set(prolog.checks) >= {"NET001", "NVL004", "NCCL018"}


def test_every_check_lives_in_the_module_of_its_family() -> None:
    """A --select run imports only the check modules of the families it names (discovery.family):
    a check filed under another family's module would silently not run."""
    from preflight.discovery import build_registry, family

    for ref_id, spec in build_registry(profile="full").checks.items():
        assert spec.origin == f"preflight.checks.{family(ref_id)}", f"{ref_id} is decided in {spec.origin}"


@pytest.mark.parametrize(("select", "families"), [(("MEM",), {"mem"}), (("ROCE005", "pci"), {"roce", "pci"}), (("memlock-limit-too-low",), {"mem"})])
def test_a_selection_registers_only_its_families_checks(select: tuple[str, ...], families: set[str]) -> None:
    from preflight.discovery import build_registry, family

    registry = build_registry(profile="full", select=select)
    assert registry.checks and {family(ref_id) for ref_id in registry.checks} == families


def test_a_token_that_names_nothing_keeps_every_check() -> None:
    """The run then refuses the token itself (inspect_node), with every reference to say so."""
    from preflight.discovery import build_registry

    assert len(build_registry(profile="full", select=("XYZ",)).checks) == len(build_registry(profile="full").checks)


def _probe_specs(*functions: object) -> list[Any]:
    return [function.__preflight_probe__ for function in functions]  # type: ignore[attr-defined]


class StepClock(Clock):
    """A monotonic clock that moves only when a probe says it worked, so durations are exact."""

    def __init__(self) -> None:
        self.reading = 0.0

    def monotonic(self) -> float:
        return self.reading


def test_probes_take_turns_and_time_only_their_own_work(example_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Probe threads run one at a time at first (no GIL hand-over at every file read), and a
    probe's duration is its own work, not its wait for a turn."""
    from preflight import engine
    from preflight.config import HostConfig
    from preflight.engine import RunOptions
    from preflight.sources import Sources

    # Turns for the whole run, however slowly a loaded machine runs the probes.
    monkeypatch.setattr(engine, "TURN_TAKING_S", 600.0)
    clock = StepClock()
    sources = msgspec.structs.replace(Sources.for_node(str(example_root)), clock=clock)
    inside: list[str] = []
    crowded: list[str] = []

    def work(name: str) -> None:
        inside.append(name)
        if len(inside) > 1:
            crowded.append(name)
        time.sleep(0.01)  # hands the GIL over: without turns another probe would come in now
        clock.reading += 1.0
        inside.remove(name)

    @probe("turn_a")
    def probe_turn_a(fs):  # type: ignore[no-untyped-def]
        work("a")

    @probe("turn_b")
    def probe_turn_b(fs):  # type: ignore[no-untyped-def]
        work("b")

    @probe("turn_c")
    def probe_turn_c(fs):  # type: ignore[no-untyped-def]
        work("c")

    outcomes = engine.run_probes(_probe_specs(probe_turn_a, probe_turn_b, probe_turn_c), sources, HostConfig(), RunOptions(probe_timeout_s=600), 600)
    assert all(outcome.status == "ok" for outcome in outcomes.values())
    assert crowded == [], "turns overlapped"
    # The last probe waited two turns (2.0 on this clock) but did 1.0 of work.
    assert [outcome.duration_s for outcome in outcomes.values()] == [1.0, 1.0, 1.0]


def test_a_hung_probe_holds_the_others_back_only_while_turns_last(example_root: Path) -> None:
    """Turn-taking ends engine.TURN_TAKING_S into the run: a probe stuck in a call then holds
    nobody back. Whichever of the two takes the first turn, the quick probe can finish only if
    it runs while the hung one is inside its call; without the end of turns it would wait for
    the hung one, which returns only after the run, and time out."""
    from preflight import engine
    from preflight.config import HostConfig
    from preflight.engine import RunOptions
    from preflight.sources import Sources

    entered, release = threading.Event(), threading.Event()

    @probe("turn_hung", timeout_s=1.0)
    def probe_turn_hung(fs):  # type: ignore[no-untyped-def]
        entered.set()
        release.wait(60)

    @probe("turn_quick")
    def probe_turn_quick(fs):  # type: ignore[no-untyped-def]
        return entered.wait(60)

    try:
        # 30 s for the quick probe: a hang guard, far beyond the end of turns.
        outcomes = engine.run_probes(_probe_specs(probe_turn_hung, probe_turn_quick), Sources.for_node(str(example_root)), HostConfig(),
                                     RunOptions(probe_timeout_s=30), time.monotonic() + 30)
    finally:
        release.set()
    assert outcomes["turn_hung"].status == "timeout"
    assert outcomes["turn_quick"].status == "ok" and outcomes["turn_quick"].facts is True


def test_a_probe_gets_the_facts_of_the_probes_it_needs_and_fails_with_them(example_root: Path) -> None:
    """A probe that names another probe as a parameter runs after it, with its facts; when the
    probe it needs fails, it reports that as its own error instead of running blind."""

    @probe("base_facts")
    def base_facts(fs):  # type: ignore[no-untyped-def]
        return {"root": fs.root}

    @probe("derived_facts")
    def derived_facts(base_facts):  # type: ignore[no-untyped-def]
        return {"derived_from": base_facts["root"]}

    @probe("broken_base")
    def broken_base(fs):  # type: ignore[no-untyped-def]
        from preflight.model import Unknown

        raise Unknown("nothing to read")

    @probe("after_broken")
    def after_broken(broken_base):  # type: ignore[no-untyped-def]
        return broken_base

    registry = registry_of(base_facts, derived_facts, broken_base, after_broken, symbols={})
    assert registry.probes["derived_facts"].needs == ("base_facts",) and registry.probes["derived_facts"].sources == ()
    assert registry.needed_probes(["derived_facts"]) == ["base_facts", "derived_facts"]
    specs = [registry.probes[name] for name in registry.needed_probes(["derived_facts", "after_broken"])]
    from preflight.config import HostConfig
    from preflight.engine import RunOptions, run_probes
    from preflight.sources import Sources

    sources = Sources.for_node(str(example_root))
    outcomes = run_probes(specs, sources, HostConfig(), RunOptions(), sources.clock.monotonic() + 5)
    assert outcomes["derived_facts"].status == "ok" and outcomes["derived_facts"].facts == {"derived_from": sources.fs.root}
    assert outcomes["after_broken"].status == "error" and "needs probe broken_base: nothing to read" in (outcomes["after_broken"].error or "")


def test_probes_that_need_each_other_in_a_circle_are_refused() -> None:
    @probe("chicken")
    def chicken(egg):  # type: ignore[no-untyped-def]
        return egg

    @probe("egg")
    def egg(chicken):  # type: ignore[no-untyped-def]
        return chicken

    with pytest.raises(RegistrationError, match="circle: chicken -> egg -> chicken"):
        registry_of(chicken, egg, symbols={})


APART_SCRIPT = """
import json, sys, time
import preflight.apart as apart
from preflight.config import HostConfig
from preflight.discovery import build_registry
from preflight.engine import RunOptions, run_probes
from preflight.sources import Sources

registry = build_registry(profile="prolog")
specs = [registry.probes[name] for name in registry.needed_probes(["memlock", "roce"])]
sources = Sources.for_node(sys.argv[1])
options = RunOptions(probe_timeout_s=60)
deadline = time.monotonic() + 60  # a hang guard only
threads = run_probes(specs, sources, HostConfig(), options, deadline)
forked = apart.run_probes_apart(run_probes, specs, sources, HostConfig(), options, deadline)
def no_fork():
    raise BlockingIOError(11, "Resource temporarily unavailable")
apart.os.fork = no_fork
fallback = apart.run_probes_apart(run_probes, specs, sources, HostConfig(), options, deadline)
print(json.dumps({
    "same": {n: (o.status, o.facts) for n, o in forked.items()} == {n: (o.status, o.facts) for n, o in threads.items()},
    "statuses": sorted({o.status for o in forked.values()}),
    "fallback_same": {n: o.facts for n, o in fallback.items()} == {n: o.facts for n, o in threads.items()},
}))
"""


def test_probes_run_apart_when_they_can_and_in_threads_when_fork_fails(example_root: Path, tmp_path: Path) -> None:
    """The child process gives the same facts as the threads; a node out of processes (fork
    fails with EAGAIN) still gets its verdicts, from probe threads in the run's own process. In a
    fresh interpreter: forking this test process, with other tests' threads in it, is what
    preflight itself refuses to do."""
    result = subprocess.run([sys.executable, "-c", APART_SCRIPT, str(example_root)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    verdict = json.loads(result.stdout)
    assert verdict == {"same": True, "statuses": ["ok"], "fallback_same": True}, verdict
