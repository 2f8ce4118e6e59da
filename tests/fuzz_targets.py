"""Fuzz targets for everything preflight reads from someone else: snapshot archives, the replay
recordings inside them (NVML, netlink, DNS, devices, statvfs, read errors), site configs, fleet
reports, slurm.conf, and whole node roots with edited files. Each target takes one input and
returns normally when preflight either used it or refused it with its own error; any other
exception is a bug (the target lets it through, or, for a node root, where the engine caught it,
raises AssertionError naming it).

``tests/reliability/test_fuzz_untrusted.py`` runs them under hypothesis, bounded for CI; ``bench/fuzz.py``
runs many more seeded inputs with time and memory measured.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import re
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from preflight.config import ConfigError, parse_config
from preflight.fleet.load import ReportError, report_from_bytes
from preflight.run import inspect_node, open_node
from preflight.sources import NodeFS, RootError, SourceError
from preflight.sources.archive import ArchiveError, extract_archive, remove_tree
from preflight.sources.dns import ReplayDns
from preflight.sources.netlink import ReplayNetlink
from preflight.sources.nvml import NvmlError, ReplayNvml

REPO = Path(__file__).resolve().parent.parent
GOLDEN_REPORT = (REPO / "tests" / "golden" / "hgx-h100.json").read_bytes()
_ROOTS = REPO / "tests" / "fixtures" / "nodes"
#: A real-shaped recording of each kind to start mutations from.
RECORDING_SEEDS = {
    name: json.loads((root / ".preflight" / name).read_text())
    for name, root in (
        ("nvml.json", REPO / "examples" / "nodes" / "hgx-h100"), ("dns.json", REPO / "examples" / "nodes" / "hgx-h100"),
        ("devices.json", REPO / "examples" / "nodes" / "hgx-h100"), ("statvfs.json", REPO / "examples" / "nodes" / "hgx-h100"),
        ("netlink.json", _ROOTS / "roce-pfc-misconfigured"), ("read-errors.json", _ROOTS / "roce-v1v2"),
    )
}


# -- archives -----------------------------------------------------------------------------------
def fuzz_archive(data: bytes) -> None:
    """Extract ``data`` as a snapshot archive into a fresh directory, then remove it."""
    with tempfile.TemporaryDirectory(prefix="preflight-fuzz-") as scratch:
        path = os.path.join(scratch, "input.tar.gz")
        with open(path, "wb") as handle:
            handle.write(data)
        target = os.path.join(scratch, "root")
        os.mkdir(target)
        try:
            extract_archive(path, target)
        except ArchiveError:
            pass
        finally:
            remove_tree(target)


def tar_bytes(entries: list[tuple[str, bytes, str]]) -> bytes:
    """A gzip tar of (name, data, type) entries; the name and type are used as given."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tarfile.GNU_FORMAT) as tar:
        for name, data, kind in entries:
            info = tarfile.TarInfo(name)
            info.type = kind.encode("latin-1")
            if info.type == tarfile.REGTYPE:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                info.linkname = data.decode("latin-1")
                tar.addfile(info)
    return buffer.getvalue()


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """A few random byte edits, cuts or splices of ``data`` (inside the gzip stream or not)."""
    raw = bytearray(gzip.decompress(data)) if rng.random() < 0.7 else bytearray(data)
    for _ in range(rng.randint(1, 6)):
        choice = rng.random()
        if choice < 0.5 and raw:
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        elif choice < 0.7:
            raw = raw[: rng.randrange(len(raw) + 1)]
        elif raw:
            at = rng.randrange(len(raw))
            raw[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 600)))
    return gzip.compress(bytes(raw)) if raw[:2] != b"\x1f\x8b" else bytes(raw)


# -- recordings ---------------------------------------------------------------------------------
def fuzz_recording(name: str, document: Any) -> None:
    """Replay a (possibly broken) recording through its source, asking what probes ask."""
    with tempfile.TemporaryDirectory(prefix="preflight-fuzz-") as scratch:
        recordings = Path(scratch) / ".preflight"
        recordings.mkdir()
        (Path(scratch) / "sys").mkdir()
        (Path(scratch) / "dev").mkdir()
        (recordings / name).write_text(json.dumps(document))
        path = str(recordings / name)
        if name == "nvml.json":
            nvml = ReplayNvml.from_file(path)
            for call, args in (("nvmlSystemGetDriverVersion", ()), ("nvmlDeviceGetCount", ()), ("nvmlDeviceGetName", (0,)),
                               ("nvmlDeviceGetNvLinkState", (0, 3)), ("nvmlDeviceGetP2PStatus", (0, "gpu1", 0))):
                try:
                    nvml.call(call, *args)  # type: ignore[arg-type]
                except NvmlError:
                    pass
        elif name == "netlink.json":
            netlink = ReplayNetlink.from_file(path)
            for ask in (netlink.links, netlink.addresses, lambda: netlink.route_get("10.0.0.9"), lambda: netlink.dcb("eth0"), lambda: netlink.pause("eth0")):
                try:
                    ask()
                except SourceError:
                    pass
        elif name == "dns.json":
            dns = ReplayDns.from_file(path)
            for ask in (dns.nameservers, lambda: dns.resolve("gpu017", "A"), lambda: dns.check_nameservers("gpu017"),
                        lambda: dns.resolve_many([("gpu017", "A"), ("gpu018", "AAAA")])):
                try:
                    ask()
                except SourceError:
                    pass
        else:  # devices.json, statvfs.json, read-errors.json: NodeFS answers from them
            fs = NodeFS(scratch)
            for ask in (lambda: fs.stat("/dev/infiniband/uverbs0"), lambda: fs.statvfs("/dev/shm"), lambda: fs.read("/sys/x")):
                try:
                    ask()
                except SourceError:
                    pass


def mutate_document(document: Any, rng: random.Random) -> Any:
    """``document`` with a few values replaced by values of other JSON types, or removed."""
    replacements: list[Any] = [None, True, -1, 0, 2**70, 1.5, "", "x" * 300, [], {}, [None], {"a": None}, "NVML_ERROR_UNKNOWN"]
    copy = json.loads(json.dumps(document))
    paths: list[list[Any]] = []

    def walk(value: Any, path: list[Any]) -> None:
        paths.append(path)
        if isinstance(value, dict):
            for key, item in list(value.items())[:40]:
                walk(item, [*path, key])
        elif isinstance(value, list):
            for index, item in enumerate(value[:10]):
                walk(item, [*path, index])

    walk(copy, [])
    def fresh() -> Any:  # a new object each time: a shared one would let a later edit make a cycle
        return json.loads(json.dumps(rng.choice(replacements)))

    for _ in range(rng.randint(1, 4)):
        path = rng.choice(paths)
        if not path:
            return fresh()
        parent = copy
        try:
            for step in path[:-1]:
                parent = parent[step]
            if isinstance(parent, dict) and rng.random() < 0.3:
                parent.pop(path[-1], None)
            else:
                parent[path[-1]] = fresh()
        except (KeyError, IndexError, TypeError):
            continue
    return copy


# -- configs and fleet reports ---------------------------------------------------------------------
def fuzz_config(text: str) -> None:
    try:
        parse_config(text, "fuzz.toml", "gpu017")
    except ConfigError:
        pass


def fuzz_fleet_report(data: bytes) -> None:
    try:
        report_from_bytes(data, "fuzz.json")
    except ReportError:
        pass


# -- slurm.conf, which a job can name ($SLURM_CONF) -------------------------------------------------
SLURM_CONF_SAMPLE = (
    "ClusterName=gpu\nInclude limits.conf\ninclude /etc/slurm/%c/nodes.conf\n"
    "PropagateResourceLimitsExcept=MEMLOCK,\\\nSTACK # keep slurmd's\nSlurmctldHost=\"head(10.0.0.1)\"\n"
)


def fuzz_slurm_conf(main: str, included: str) -> None:
    """Read ``main`` as /etc/slurm/slurm.conf, every Include it names answering ``included``."""
    from preflight.slurm_conf import propagated, read_slurm_conf

    conf = read_slurm_conf(lambda path: main if path == "/etc/slurm/slurm.conf" else included, "/etc/slurm/slurm.conf")
    assert conf is not None and len(conf.unread) <= 8
    for limit in ("MEMLOCK", "STACK"):
        decided, setting = propagated(conf, limit)
        assert decided in (True, False, None) and isinstance(setting, str)



# -- whole node roots: every probe and check over mutated sysfs, procfs, configs and recordings ---
#: Roots to mutate: the example node and every fixture root (recorded kernel formats).
NODE_ROOT_SEEDS = sorted([REPO / "examples" / "nodes" / "hgx-h100", *(path for path in _ROOTS.iterdir() if path.is_dir())])
#: Values that parse as numbers in some readers and not in others, or overflow them.
_ODD_TOKENS = [b"-1", b"0", b"99999999999999999999999", b"nan", b"inf", b"", b"0x", b"1e309", b"-0", b"\x00",
               "é".encode(), b"4294967296", b" ", b"1.5", b"18446744073709551616", b"9" * 5000]
# The engine's catch-alls name the exception's type first ("KeyError: 'x'"), or say "check
# failed"; preflight's own errors name the source read ("/sys/...: ...", "NVML: ...").
_INTERNAL_ERROR = re.compile(r"^(check failed: )?[A-Z]\w*(Error|Exception|Iteration): ")


def mutate_text(data: bytes, rng: random.Random) -> bytes:
    """One edit of a sysfs/procfs/config file: cut short, a number made odd, bytes flipped,
    replaced by junk, lines shuffled or dropped, or junk appended."""
    choice = rng.randrange(6)
    if choice == 0 and data:
        return data[: rng.randrange(len(data))]
    tokens = re.findall(rb"[0-9a-fx.:]+", data)
    if choice == 1 and tokens:
        return data.replace(rng.choice(tokens), rng.choice(_ODD_TOKENS), 1)
    if choice == 2 and data:
        edited = bytearray(data)
        for _ in range(rng.randint(1, 5)):
            edited[rng.randrange(len(edited))] = rng.randrange(256)
        return bytes(edited)
    if choice == 3:
        return rng.randbytes(rng.randint(0, 64))
    if choice == 4:
        lines = data.split(b"\n")
        rng.shuffle(lines)
        return b"\n".join(lines[: rng.randint(0, len(lines))])
    return data + rng.choice([b"\n\n\n", b" x y z\n", b"\t-5\n", b"=\n", b"\xff", b"9" * 5000])


#: The job-environment variables preflight's code names ("NCCL_IB_HCA", "SLURM_JOB_GPUS", ...),
#: found in its source, and values that parsers of such settings trip over.
JOB_VARIABLES = sorted({
    name for path in (*(REPO / "checks").glob("*.py"), *(REPO / "preflight").rglob("*.py"))
    for name in re.findall(r'"((?:NCCL|SLURM|CUDA|TORCH|GLOO|UCX|FI|OMPI|PMIX|NVSHMEM|GDRCOPY|MASTER|WORLD|LOCAL|GROUP|HOROVOD|VLLM)_[A-Z0-9_]*[A-Z0-9])"', path.read_text())
} | {"RANK", "HOME", "LD_LIBRARY_PATH", "LD_PRELOAD", "VIRTUAL_ENV", "CONDA_PREFIX"})
_ODD_SETTINGS = ["", "0", "1", "-1", "99999999999999999999", "nan", "=", "^", "^=", ":", ",,,", "mlx5_0:1:2:3", "eth0,^docker",
                 "é" * 50, "x" * 5000, "0x10", "1e9", "AF_INET6", "gpu[001-999999]", "gpu[", "0-3,5", "3-1", "10.0.0.1:29500",
                 "[::1]:80", "127.0.1.1", "/tmp/../../etc", "/dev/null", " 1 ", "true",
                 "²", "1²", "٣", "9" * 5000]  # str.isdigit() takes a superscript two, which int() refuses


def random_job_environment(rng: random.Random) -> bytes:
    """A /proc/self/environ of up to a dozen variables preflight reads, with odd values."""
    chosen = {rng.choice(JOB_VARIABLES): rng.choice(_ODD_SETTINGS) for _ in range(rng.randint(1, 12))}
    if rng.random() < 0.5:
        chosen["SLURM_JOB_ID"] = "42"  # one of a job's processes: the job's settings are judged
    return b"".join(f"{name}={value}".encode() + b"\0" for name, value in chosen.items())


def fuzz_root(seed_root: Path, rng: random.Random) -> None:
    """Copy ``seed_root``, edit one to four of its files (or give it a random job environment),
    run every probe and check on it. A probe or check that fails with a Python exception instead
    of saying what it could not read is a bug (AssertionError); a root refused as a whole is fine."""
    with tempfile.TemporaryDirectory(prefix="preflight-fuzz-") as scratch:
        root = Path(scratch) / "root"
        shutil.copytree(seed_root, root, symlinks=True)
        files = sorted(path for path in root.rglob("*") if path.is_file() and not path.is_symlink())
        if rng.random() < 0.3:
            environ = root / "proc/self/environ"
            if environ.is_symlink():
                environ.unlink()
            environ.parent.mkdir(parents=True, exist_ok=True)
            environ.write_bytes(random_job_environment(rng))
            files = []
        for path in (rng.choice(files) for _ in range(rng.randint(1, 4) if files else 0)):
            data = path.read_bytes()
            if path.parent.name == ".preflight" and path.suffix == ".json" and rng.random() < 0.7:
                try:
                    path.write_text(json.dumps(mutate_document(json.loads(data), rng)))
                    continue
                except ValueError:  # already broken by an earlier edit: edit it as text
                    pass
            path.write_bytes(mutate_text(data, rng))
        assert_judged_without_crash(root)


def assert_judged_without_crash(root: Path) -> None:
    """Every probe and check on ``root`` either reads it or says what it could not read: a Python
    exception is a bug (AssertionError); a root refused as a whole is fine."""
    with tempfile.TemporaryDirectory(prefix="preflight-fuzz-config-") as scratch:
        config = Path(scratch) / "preflight.toml"
        config.write_text("")
        try:
            report = inspect_node(open_node(str(root), str(config)), timeout_s=30)
        except RootError:
            return
    internal = [f"probe {outcome.name}: {outcome.error}" for outcome in report.probes if _INTERNAL_ERROR.match(outcome.error or "")]
    internal += [f"{finding.reference_id}: {finding.reason}" for finding in report.findings if _INTERNAL_ERROR.match(finding.reason)]
    assert not internal, internal
