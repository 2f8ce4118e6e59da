"""``preflight snapshot``: record what the probes read on this node (or on a recorded root) and
write it as a recorded root packed in a ``.tar.gz``, which ``preflight node --root`` replays with
the same findings. The format is described in docs/operators/snapshots.md.

The run is an ordinary ``preflight node`` run (all checks of the profile, ``full`` by default)
whose sources are wrapped by ``preflight.sources.recording``; the recorded answers become files:

* every file read, at its resolved path, with the symlinks that lead to it; every directory
  listing (entries not read become empty placeholder files, directories or links);
* ``.preflight/devices.json``: every ``stat`` answer (an archive keeps no owners or sysfs sizes);
* ``.preflight/statvfs.json``: every ``statvfs`` answer (file-system size and free space);
* ``.preflight/read-errors.json``: every read, listing, stat or readlink that failed, by errno;
* ``.preflight/kmsg``: the kernel log as read;
* ``.preflight/nvml.json``, ``netlink.json``, ``dns.json``: the answers of those sources;
* ``.preflight/firewall.json``: the nftables ruleset as the firewall probe read it;
* ``.preflight/snapshot.json``: the manifest (format, version, time, profile, scrubbing, the
  findings of the recording run, and anything that could not be recorded exactly).

The job environment (``/proc/<pid>/environ``) is recorded too, because checks read it, by allow-list:
the values of the variables checks read are kept (without credentials in URLs), every other
variable keeps only its name (its value becomes ``<redacted>``), and so does any whose name looks
like a secret.
"""

from __future__ import annotations

import os
import re
import stat as stat_codes
import time
from typing import Any

from msgspec import Struct, field
from msgspec.structs import replace

from preflight import __version__
from preflight.engine import Report
from preflight.sources import NodeFS, RootError, SourceError, Sources
from preflight.sources.archive import Member
from preflight.sources.fs import FileStat
from preflight.sources.recording import Recorders, RecordingFS, record

SNAPSHOT_FORMAT = "preflight-snapshot/1"
MANIFEST = ".preflight/snapshot.json"
CONFIG_PATH = "/etc/preflight/preflight.toml"
REDACTED = b"<redacted>"
# Names of environment variables whose values are never written into a snapshot.
# Matching harmless ones (SSH_AUTH_SOCK) costs nothing: no check reads them; missing one
# (PREFLIGHT_SCRUB_KEY itself) would leak it into every bug report.
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|PRIVATE|KEY|AUTH|COOKIE|SESSION|JWT", re.IGNORECASE)
_ENVIRON_PATH = re.compile(r"^proc/[^/]+/environ$")
# user:password@ (or a token@) after a URL scheme, wherever it sits in a value
_URL_CREDENTIALS = re.compile(rb"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")
_STAT_TYPES = {
    stat_codes.S_IFCHR: "char", stat_codes.S_IFBLK: "block", stat_codes.S_IFDIR: "dir",
    stat_codes.S_IFIFO: "fifo", stat_codes.S_IFSOCK: "socket", stat_codes.S_IFREG: "file",
}


class SnapshotArgs(Struct, frozen=True):
    """Arguments of ``preflight snapshot``."""

    output: str
    root: str = "/"
    config: str | None = None
    profile: str | None = None
    scrub: tuple[str, ...] = ()
    scrub_key: str | None = None
    timeout: float | None = None
    checks_dirs: tuple[str, ...] = ()


class Snapshot(Struct, frozen=True):
    """A recorded root in memory, before it is written."""

    members: dict[str, Member]
    manifest: dict[str, Any]
    report: Report
    notes: list[str] = field(default_factory=list)


class SnapshotResult(Struct, frozen=True):
    path: str
    size: int
    members: int
    seconds: float
    snapshot: Snapshot


def record_node(args: SnapshotArgs) -> Snapshot:
    """Run every check of the profile on ``args.root`` through recording sources; the recorded
    root (not yet scrubbed). Raises RootError, ConfigError, RegistrationError, CatalogueError,
    ArchiveError or UsageProblem."""
    from preflight.run import (
        check_profile,
        check_timeout,
        inspect_node,
        open_node,
        unpack_budget,
    )
    from preflight.sources.archive import opened_root

    check_profile(args.profile)
    check_timeout(args.timeout)
    with opened_root(args.root, time.monotonic() + unpack_budget(args.root, args.timeout, args.config)) as (directory, _label):
        # open_node gives the same RootError as `preflight node` for a missing root
        fs = RecordingFS(os.path.abspath(directory))
        node = open_node(directory, args.config, fs)
        config = node.config
        config_text = _site_config_text(args.config)
        plain = Sources.for_fs(fs, config.dns)
        recorders = record(fs, plain.nvml, plain.netlink, plain.dns)
        sources = Sources(fs, recorders.nvml or plain.nvml, recorders.netlink or plain.netlink, recorders.dns or plain.dns)
        profile = args.profile or "full"  # full runs every check: a superset of prolog's reads
        report = inspect_node(node, profile=profile, timeout_s=args.timeout, checks_dirs=args.checks_dirs, sources=sources)
        members, notes = recorded_members(recorders, config_text)
    if config.checks_dirs or args.checks_dirs:
        notes.append("site check modules (--checks-dir, [run] checks_dirs) are not part of the snapshot")
    manifest: dict[str, Any] = {
        "format": SNAPSHOT_FORMAT,
        "preflight": __version__,
        "taken_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(report.started_at)),
        "profile": profile,
        "source": "live node" if fs.is_live else "recorded root",
        "scrub": {"categories": []},
        "redacted_environment": sorted(_redact_environments(members)),
        "summary": {status: sum(1 for f in report.findings if f.status.value == status) for status in ("present", "absent", "not_applicable", "unknown")},
        "findings": [[f.reference_id, f.subject, f.status.value] for f in report.findings],
        "inexact": notes,
    }
    return Snapshot(members, manifest, report, notes)


def _site_config_text(path: str | None) -> bytes | None:
    """``--config FILE`` goes into the snapshot as the node's own config, so the replay judges
    with the same expectations."""
    if path is None:
        return None
    machine_fs = NodeFS("/")  # --config names a file on this machine, not under --root
    try:
        return machine_fs.read_bytes(os.path.abspath(path), max_bytes=1024 * 1024)
    except SourceError:
        return None  # load_host_config has already reported an unreadable file


def recorded_members(recorders: Recorders, config_text: bytes | None = None) -> tuple[dict[str, Member], list[str]]:
    """The recorded root as archive members (paths relative to the root), and notes on what the
    format could not reproduce exactly."""
    tree = recorders.fs.recording
    notes = list(dict.fromkeys(tree.inexact))
    members: dict[str, Member] = {}

    def add(member: Member) -> None:
        if member.path and member.path not in members:
            members[member.path] = member

    for path, target in sorted(tree.links.items()):
        add(Member(_relative(path), "link", target=target))
    for path in sorted(tree.dirs):
        add(Member(_relative(path), "dir"))
    for path, data in sorted(tree.files.items()):
        add(Member(_relative(path), "file", data))
    for path in sorted(tree.placeholders):
        add(Member(_relative(path), "file"))
    if config_text is not None:
        members[_relative(CONFIG_PATH)] = Member(_relative(CONFIG_PATH), "file", config_text)

    documents: dict[str, Any] = {}
    if tree.device_nodes_known:  # even with no stat: it says the node's /dev was looked at
        documents["devices.json"] = {
            "format": "preflight-devices/1",
            "nodes": {path: _stat_entry(answer) for path, answer in sorted(tree.stats.items())},
        }
    if tree.statvfs:
        documents["statvfs.json"] = {"format": "preflight-statvfs/1", "mounts": dict(sorted(tree.statvfs.items()))}
    if tree.errors:
        errors: dict[str, Any] = {"format": "preflight-read-errors/1", "errors": dict(sorted(tree.errors.get("read", {}).items()))}
        for operation in ("listdir", "stat", "readlink"):
            if operation in tree.errors:
                errors[operation] = dict(sorted(tree.errors[operation].items()))
        documents["read-errors.json"] = errors
    if recorders.nvml is not None:
        documents["nvml.json"] = recorders.nvml.document()
    if recorders.netlink is not None:
        if not recorders.netlink.links_from_files:
            documents["netlink.json"] = recorders.netlink.document()
        firewall = recorders.netlink.firewall_document()
        if firewall is not None:
            documents["firewall.json"] = firewall
        notes += [f"netlink {key}: still running when recorded; replays as missing" for key in recorders.netlink.hung()]
    if recorders.dns is not None:
        documents["dns.json"] = recorders.dns.document()
    for name, document in documents.items():
        members[f".preflight/{name}"] = Member(f".preflight/{name}", "file", _json_bytes(document))
    if tree.kernel_log is not None:
        text = "".join(f"{record}\n" for record in tree.kernel_log)
        members[".preflight/kmsg"] = Member(".preflight/kmsg", "file", text.encode("utf-8"))
    notes += [f"NodeFS.{name} was called but is not recorded by this version" for name in sorted(tree.unrecorded)]
    _add_parents(members)
    return members, notes


def _relative(path: str) -> str:
    return path.strip("/")


def _stat_entry(answer: FileStat) -> dict[str, Any]:
    return {
        "type": _STAT_TYPES.get(stat_codes.S_IFMT(answer.mode), "file"),
        "mode": f"{stat_codes.S_IMODE(answer.mode):04o}",
        "uid": answer.uid,
        "gid": answer.gid,
        "size": answer.size,
    }


def _json_bytes(document: Any) -> bytes:
    import json

    return (json.dumps(document) + "\n").encode("utf-8")  # the C encoder: indent would cost ~10x


def _add_parents(members: dict[str, Member]) -> None:
    for path in list(members):
        parent = os.path.dirname(path)
        while parent and parent not in members:
            members[parent] = Member(parent, "dir")
            parent = os.path.dirname(parent)


def _redact_environments(members: dict[str, Member]) -> set[str]:
    """Keep in every recorded ``environ`` only the values checks read (the allow-list of
    :mod:`preflight.probes.job`: NCCL, CUDA, torch, UCX, libfabric, Slurm... and a few plain names),
    without credentials in URLs; every other variable keeps its name, its value becomes
    ``<redacted>``. Returns the names whose values were not recorded."""
    from preflight.probes.job import KEPT_NAMES, KEPT_PREFIXES

    redacted: set[str] = set()
    for path, member in list(members.items()):
        if member.kind != "file" or not _ENVIRON_PATH.match(path):
            continue
        items = []
        for item in member.data.split(b"\0"):
            raw_name, equals, value = item.partition(b"=")
            name = raw_name.decode("utf-8", "replace")
            if equals:
                kept = (name in KEPT_NAMES or name.startswith(KEPT_PREFIXES)) and not SECRET_NAME.search(name)
                if kept:
                    item = raw_name + b"=" + _URL_CREDENTIALS.sub(rb"\1<redacted>@", value)
                else:
                    redacted.add(name)
                    item = raw_name + b"=" + REDACTED
            items.append(item)
        members[path] = replace(member, data=b"\0".join(items))
    return redacted


OUTPUT_SUFFIXES = (".tar.gz", ".tgz")


def _check_output_name(output: str) -> None:
    """A snapshot is a gzip-compressed tar: refuse a name that promises another format
    (``x.zip``, ``x.tar``) or none (a directory), which would hold what its name does not say."""
    from preflight.run import UsageProblem

    if not output.lower().endswith(OUTPUT_SUFFIXES):
        raise UsageProblem(f"{output}: a snapshot is a gzip-compressed tar archive; name it *.tar.gz or *.tgz")


def take_snapshot(args: SnapshotArgs) -> SnapshotResult:
    """Record, scrub as asked, and write the archive. Raises what :func:`record_node` raises,
    ArchiveError for an unwritable destination, ScrubError for bad scrub options."""
    from preflight.scrub import Scrubber, ScrubError, parse_categories
    from preflight.sources.archive import write_archive

    begin = time.monotonic()
    _check_output_name(args.output)
    categories = parse_categories(args.scrub)  # before recording: a typo must fail fast
    if args.scrub_key and not categories:
        raise ScrubError("--scrub-key (or PREFLIGHT_SCRUB_KEY) given without --scrub: nothing would be scrubbed; "
                         "name what to replace, e.g. --scrub all")
    snapshot = record_node(args)
    members, manifest = snapshot.members, snapshot.manifest
    if categories:
        scrubber = Scrubber(categories, args.scrub_key)
        members = scrubber.scrub_members(members)
        manifest = scrubber.scrub_manifest(manifest)
    members[MANIFEST] = Member(MANIFEST, "file", _json_bytes(manifest))
    size = write_archive(args.output, members.values(), snapshot.report.started_at)
    final = Snapshot(members, manifest, snapshot.report, snapshot.notes)
    return SnapshotResult(os.path.abspath(args.output), size, len(members), time.monotonic() - begin, final)


def run_snapshot(args: SnapshotArgs) -> int:
    """``preflight snapshot``: write the archive and say where; the exit code. Never raises."""
    import sys

    from preflight.catalogue import CatalogueError
    from preflight.config import ConfigError
    from preflight.exitcodes import ExitCode
    from preflight.registry import RegistrationError
    from preflight.run import UsageProblem
    from preflight.scrub import ScrubError
    from preflight.sources.archive import ArchiveError

    try:
        result = take_snapshot(args)
    except (UsageProblem, RootError, ConfigError, RegistrationError, CatalogueError, ArchiveError, ScrubError) as error:
        print(f"preflight: error: {error}", file=sys.stderr)
        return ExitCode.NO_VERDICT
    summary = result.snapshot.manifest["summary"]
    print(
        f"wrote {result.path}: {result.size} bytes, {result.members} entries, in {result.seconds:.2f} s "
        f"({summary['present']} present, {summary['unknown']} unknown); replay with: preflight node --root {result.path}",
        file=sys.stderr,
    )
    for note in result.snapshot.manifest.get("inexact", [])[:10]:
        print(f"preflight: note: {note}", file=sys.stderr)
    return ExitCode.OK
