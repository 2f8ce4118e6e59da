"""Import one real machine's capture of ``/sys``, ``/proc``, ``/etc`` and ``/dev`` into this corpus.

Usage::

    python3 import_capture.py SOURCE NAME [--prefix DIR] [--exclude PATTERN]... [--out DIR]

``SOURCE`` is a tar archive (any compression ``tarfile`` reads) or a directory holding the
capture; ``--prefix`` names the capture's root inside it (``128arm-2pa2n8cluster4co`` or
``topo/fsroot``); without it, single top-level directories are descended until one holds
``sys``, ``proc``, ``etc`` or ``dev``. ``--exclude`` (repeatable, ``fnmatch`` on paths relative
to the capture's root) drops a part the source documents as hand-written. The result is
``OUT/NAME.tar.gz`` (``OUT`` defaults to this script's directory) whose members are
``sys/...``, ``proc/...`` relative to the capture's root.

Only what preflight's checks read is kept (see ``ROOT`` below and README.md); everything else is
pruned. Nothing is invented or edited: file contents are copied byte for byte, symlinks stay
symlinks, and a ``sys/class/*/*`` or ``sys/bus/pci/devices/*`` link keeps the ``sys/devices/...``
directory it points to, pruned to the same attribute lists, plus the attributes of every PCI
bridge above it. Hard links become regular files; device nodes, FIFOs and sockets are dropped,
as are links whose relative target climbs out of the capture (preflight refuses those). The
archive is reproducible: sorted members, mtime 0, owner root.
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import io
import os
import posixpath
import re
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field

KEEP = "keep"  # keep this entry only (a link stays a link, not followed; a directory stays empty)
ALL = "all"  # keep this entry and everything below it, links kept but not followed
_BDF = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_MAX_HOPS = 40


@dataclass(frozen=True)
class Entry:
    """One entry of a capture: ``kind`` is ``file``, ``dir`` or ``link``."""

    kind: str
    data: bytes = b""
    target: str = ""


Tree = dict[str, Entry]  # path relative to the capture's root ("" is the root) -> entry


class Rule:
    """What to keep below a directory: ``pick(name, entry)`` answers, for each child, None
    (drop it), KEEP, ALL, or a Rule to apply to it (a link is kept and its target followed)."""

    def __init__(self, pick: Callable[[str, Entry], Rule | str | None]) -> None:
        self.pick = pick


def names(table: dict[str, Rule | str]) -> Rule:
    """A Rule keeping exactly the children named in ``table``."""
    return Rule(lambda name, _entry: table.get(name))


def every(action: Rule | str) -> Rule:
    """A Rule applying ``action`` to every child."""
    return Rule(lambda _name, _entry: action)


PCI_ATTRIBUTES = frozenset({
    "vendor", "device", "subsystem_vendor", "subsystem_device", "class", "revision", "config",
    "numa_node", "local_cpulist", "local_cpus", "current_link_speed", "current_link_width",
    "max_link_speed", "max_link_width", "resource", "driver", "uevent",
})
NET_ATTRIBUTES = frozenset({
    "address", "ifindex", "mtu", "operstate", "type", "uevent", "mode", "dev_port", "carrier",
    "speed", "dev_id", "upper_dev",
})
IOMMU_GROUP = names({"type": KEEP})


def _pick_ib(name: str, entry: Entry) -> Rule | str | None:
    if name == "device":
        return PCI
    if name in ("subsystem", "power"):
        return None
    return IB if entry.kind == "dir" else KEEP


def _pick_net(name: str, entry: Entry) -> Rule | str | None:
    if name in NET_ATTRIBUTES:
        return KEEP
    if name == "device":
        return PCI
    if name == "master" or name.startswith("lower_"):
        return NET
    if name.startswith("upper_"):
        return KEEP
    if name == "bonding":
        return names({"slaves": KEEP, "mode": KEEP})
    if name in ("ecn", "qos"):
        return ALL
    return None


def _pick_pci(name: str, entry: Entry) -> Rule | str | None:
    if name in PCI_ATTRIBUTES:
        return KEEP
    if name == "iommu_group":
        return IOMMU_GROUP
    if name in ("infiniband", "infiniband_verbs"):
        return every(IB)
    if name == "net":
        return every(NET)
    return None


def _pick_bridge(name: str, entry: Entry) -> Rule | str | None:
    if name in PCI_ATTRIBUTES:
        return KEEP
    return IOMMU_GROUP if name == "iommu_group" else None


def _pick_node(name: str, entry: Entry) -> Rule | str | None:
    if re.fullmatch(r"node[0-9]+", name):
        return names({"cpulist": KEEP, "cpumap": KEEP, "distance": KEEP, "meminfo": KEEP})
    return KEEP if entry.kind == "file" else None


def _pick_proc(name: str, entry: Entry) -> Rule | str | None:
    if name in ("cpuinfo", "meminfo", "cmdline"):
        return KEEP
    if name == "self":
        return names({n: KEEP for n in ("limits", "status", "environ", "comm", "stat")})
    if name.isdigit():
        return names({"comm": KEEP, "stat": KEEP, "limits": KEEP})
    if name == "net":
        return names({n: KEEP for n in ("fib_trie", "if_inet6", "route", "tcp", "tcp6", "dev",
                                         "ipv6_route", "unix")})
    if name == "sys":
        return names({"kernel": names({"hostname": KEEP, "osrelease": KEEP, "domainname": KEEP}),
                      "net": ALL})
    if name == "driver":
        return names({"nvidia": ALL})
    return None


IB = Rule(_pick_ib)
NET = Rule(_pick_net)
PCI = Rule(_pick_pci)
BRIDGE = Rule(_pick_bridge)
SYS = names({
    "class": names({"infiniband": every(IB), "infiniband_verbs": every(IB), "net": every(NET),
                    "iommu": every(Rule(lambda _n, e: KEEP if e.kind != "dir" else None))}),
    "kernel": names({"iommu_groups": every(IOMMU_GROUP), "mm": names({"memory_peers": ALL})}),
    "module": every(names({"version": KEEP})),
    "devices": names({"system": names({"node": Rule(_pick_node)})}),
    "bus": names({"pci": names({"devices": every(PCI)})}),
})
ETC = names({
    "hosts": KEEP, "hostname": KEEP, "resolv.conf": KEEP, "nsswitch.conf": KEEP, "nccl.conf": KEEP,
    "ld.so.conf": KEEP, "ld.so.conf.d": ALL,
    "security": names({"limits.conf": KEEP, "limits.d": ALL}),
    "slurm": names({"slurm.conf": KEEP}), "systemd": names({"system.conf": KEEP}),
})
ROOT = names({"sys": SYS, "proc": Rule(_pick_proc), "etc": ETC, "dev": ALL})


@dataclass
class Capture:
    """A loaded capture and the selection made from it."""

    tree: Tree
    notes: list[str] = field(default_factory=list)
    kept: set[str] = field(default_factory=set)
    _seen: set[tuple[str, int]] = field(default_factory=set)
    _children: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for path in sorted(self.tree):
            if path:
                self._children.setdefault(posixpath.dirname(path), []).append(path)

    def children(self, path: str) -> list[str]:
        return self._children.get(path, [])

    def keep(self, path: str) -> None:
        while path and path not in self.kept:
            self.kept.add(path)
            path = posixpath.dirname(path)

    def resolve(self, path: str, hops: int = 0) -> str | None:
        """The physical path a (link) path leads to inside the capture, keeping every link passed."""
        current = ""
        for part in path.split("/"):
            current = posixpath.join(current, part) if current else part
            entry = self.tree.get(current)
            if entry is None:
                return None
            if entry.kind == "link":
                if hops >= _MAX_HOPS:
                    return None
                self.keep(current)
                base = "" if entry.target.startswith("/") else posixpath.dirname(current)
                joined = posixpath.normpath(posixpath.join(base, entry.target.lstrip("/")))
                if joined.startswith("..") or joined == ".":
                    return None
                found = self.resolve(joined, hops + 1)
                if found is None:
                    return None
                current = found
        return current

    def apply(self, path: str, rule: Rule) -> None:
        if (path, id(rule)) in self._seen:
            return
        self._seen.add((path, id(rule)))
        self.keep(path)
        for child in self.children(path):
            self.handle(child, rule.pick(posixpath.basename(child), self.tree[child]))

    def handle(self, path: str, action: Rule | str | None) -> None:
        entry = self.tree[path]
        if action is None:
            return
        if action == KEEP or entry.kind == "file":
            self.keep(path)
        elif action == ALL:
            self.keep(path)
            self.kept.update(p for p in self.tree if p.startswith(f"{path}/"))
        elif isinstance(action, Rule):
            if entry.kind == "dir":
                self.apply(path, action)
            else:
                self.keep(path)
                target = self.resolve(path)
                if target is not None and self.tree[target].kind == "dir":
                    self.apply(target, action)

    def select(self) -> None:
        self.apply("", ROOT)
        while True:  # every PCI bridge above a kept device keeps its own attributes
            bridges = {a for p in self.kept if p.startswith("sys/devices/")
                       for a in _ancestors(p) if _BDF.match(posixpath.basename(a))
                       and self.tree.get(a, Entry("file")).kind == "dir"}
            if all((b, id(BRIDGE)) in self._seen or (b, id(PCI)) in self._seen for b in bridges):
                break
            for bridge in sorted(bridges):
                self.apply(bridge, BRIDGE)
        for path in sorted(self.kept):
            entry = self.tree[path]
            if entry.kind == "link" and not entry.target.startswith("/") and _escapes(path, entry.target):
                self.kept.discard(path)
                self.notes.append(f"dropped link {path} -> {entry.target}: it leaves the capture")


def _ancestors(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def _escapes(path: str, target: str) -> bool:
    depth = len(path.split("/")) - 1
    for part in target.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                return True
        elif part not in ("", "."):
            depth += 1
    return False


def _clean(name: str) -> str:
    return "/".join(p for p in name.split("/") if p not in ("", "."))


def load_tar(source: str, notes: list[str]) -> Tree:
    tree: Tree = {"": Entry("dir")}
    with tarfile.open(source, "r:*") as tar:
        for member in tar:
            name = _clean(member.name)
            if not name or ".." in name.split("/"):
                continue
            if member.isdir():
                tree[name] = Entry("dir")
            elif member.issym():
                tree[name] = Entry("link", target=member.linkname)
            elif member.isreg() or member.islnk():
                handle = tar.extractfile(member)
                tree[name] = Entry("file", handle.read() if handle else b"")
                if member.islnk():
                    notes.append(f"hard link {name} -> {member.linkname} stored as a regular file")
            else:
                notes.append(f"dropped {name}: not a file, directory or symlink")
                continue
            for parent in _ancestors(name):
                tree.setdefault(parent, Entry("dir"))
    return tree


def load_dir(source: str, notes: list[str]) -> Tree:
    tree: Tree = {"": Entry("dir")}
    for top, dirs, files in os.walk(source):
        rel = _clean(os.path.relpath(top, source).replace(os.sep, "/"))
        for name in dirs + files:
            path = os.path.join(top, name)
            key = f"{rel}/{name}" if rel else name
            if os.path.islink(path):
                tree[key] = Entry("link", target=os.readlink(path))
            elif os.path.isdir(path):
                tree[key] = Entry("dir")
            elif os.path.isfile(path):
                with open(path, "rb") as handle:
                    tree[key] = Entry("file", handle.read())
            else:
                notes.append(f"dropped {key}: not a file, directory or symlink")
    return tree


def rebase(tree: Tree, prefix: str | None) -> Tree:
    """The subtree at ``prefix`` (or the first directory down holding sys/proc/etc/dev)."""
    if prefix is None:
        prefix = ""
        while True:
            kids = {p.split("/")[len(prefix.split("/")) if prefix else 0] for p in tree
                    if p and (not prefix or p.startswith(f"{prefix}/"))}
            if kids & {"sys", "proc", "etc", "dev"} or len(kids) != 1:
                break
            only = f"{prefix}/{kids.pop()}" if prefix else kids.pop()
            if tree[only].kind != "dir":
                break
            prefix = only
    prefix = _clean(prefix)
    if not prefix:
        return tree
    if tree.get(prefix, Entry("file")).kind != "dir":
        raise SystemExit(f"import_capture: {prefix!r} is not a directory of the source")
    cut = len(prefix) + 1
    rebased: Tree = {"": Entry("dir")}
    rebased.update({p[cut:]: e for p, e in tree.items() if p.startswith(f"{prefix}/")})
    return rebased


def has(capture: Capture) -> list[str]:
    """What the pruned capture holds, in PROVENANCE.toml's vocabulary."""
    kept = capture.kept
    found: list[str] = [top for top in ("sys", "proc", "etc", "dev") if top in kept]
    for label, directory in (("infiniband", "sys/class/infiniband"), ("net", "sys/class/net"),
                             ("pci", "sys/bus/pci/devices")):
        if any(p.startswith(f"{directory}/") for p in kept):
            found.append(label)
    gpus = False
    for path in kept:
        if path.endswith("/vendor") and capture.tree[path].data.strip() == b"0x10de":
            klass = capture.tree.get(posixpath.join(posixpath.dirname(path), "class"))
            gpus = gpus or (klass is not None and klass.data.strip().startswith(b"0x03"))
    if gpus:
        found.append("nvidia-gpus")
    if "proc/driver/nvidia" in kept:
        found.append("nvidia-driver")
    return found


def write(capture: Capture, destination: str) -> int:
    raw = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as packed:
        with tarfile.open(fileobj=packed, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for path in sorted(capture.kept):
                entry = capture.tree[path]
                info = tarfile.TarInfo(path)
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "root", "root"
                if entry.kind == "dir":
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(info)
                elif entry.kind == "link":
                    info.type, info.mode, info.linkname = tarfile.SYMTYPE, 0o777, entry.target
                    tar.addfile(info)
                else:
                    info.size, info.mode = len(entry.data), 0o644
                    tar.addfile(info, io.BytesIO(entry.data))
    with open(destination, "wb") as out:
        out.write(raw.getvalue())
    return len(raw.getvalue())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="tar archive or directory holding the capture")
    parser.add_argument("name", help="corpus name: writes NAME.tar.gz")
    parser.add_argument("--prefix", help="the capture's root inside the source")
    parser.add_argument("--exclude", action="append", default=[], help="drop paths matching this")
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)),
                        help="directory to write NAME.tar.gz to (default: beside this script)")
    args = parser.parse_args(argv)
    notes: list[str] = []
    tree = load_dir(args.source, notes) if os.path.isdir(args.source) else load_tar(args.source, notes)
    tree = rebase(tree, args.prefix)
    for pattern in args.exclude:
        dropped = {p for p in tree if p and any(fnmatch.fnmatchcase(a, pattern) for a in [*_ancestors(p), p])}
        notes.append(f"excluded {len(dropped)} entries matching {pattern}")
        tree = {p: e for p, e in tree.items() if p not in dropped}
    capture = Capture(tree, notes)
    capture.select()
    if not capture.kept:
        print(f"import_capture: nothing to keep in {args.source}", file=sys.stderr)
        return 1
    size = write(capture, os.path.join(args.out, f"{args.name}.tar.gz"))
    kinds = [capture.tree[p].kind for p in capture.kept]
    print(f"{args.name}: {size} bytes; {kinds.count('file')} files, {kinds.count('dir')} dirs, "
          f"{kinds.count('link')} links; has = {has(capture)}")
    for note in notes[:20]:
        print(f"  note: {note}")
    if len(notes) > 20:
        print(f"  note: ... {len(notes) - 20} more")
    return 0


if __name__ == "__main__":
    sys.exit(main())
