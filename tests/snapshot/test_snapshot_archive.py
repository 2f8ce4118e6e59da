"""Opening a snapshot archive trusts nothing in it: garbage, truncation, path traversal, links out
of the archive, writes through links, hard links, devices, duplicates and bombs are refused with a
clear error (exit 3, no traceback), nothing is written outside the private temporary directory,
and that directory is removed."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import EXAMPLE_ROOT, Runner
from preflight.snapshot import SnapshotArgs, take_snapshot
from preflight.sources import archive as archive_module
from preflight.sources.archive import ArchiveError, extract_archive, opened_root

Build = Callable[[tarfile.TarFile], None]


def make_tar(path: Path, build: Build) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        build(tar)
    return path


def add_file(tar: tarfile.TarFile, name: str, data: bytes = b"x\n") -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def add_entry(tar: tarfile.TarFile, name: str, kind: bytes, target: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    tar.addfile(info)


#: Each builder gets a directory outside the snapshot (the test's own) to aim absolute paths at.
BAD_ARCHIVES: dict[str, tuple[Callable[[tarfile.TarFile, str], object], str]] = {
    "parent-traversal": (lambda tar, outside: add_file(tar, "../escaped"), "'..' in its path"),
    "nested-traversal": (lambda tar, outside: add_file(tar, "sys/../../escaped"), "'..' in its path"),
    "absolute-member": (lambda tar, outside: add_file(tar, f"{outside}/escaped"), "absolute path"),
    "link-out-of-archive": (lambda tar, outside: add_entry(tar, "sys/class/x", tarfile.SYMTYPE, "../../../../etc"), "points outside the snapshot"),
    "write-through-link": (
        lambda tar, outside: (add_entry(tar, "etc", tarfile.SYMTYPE, outside), add_file(tar, "etc/escaped")),
        "passes through a non-directory entry",
    ),
    "hard-link": (lambda tar, outside: (add_file(tar, "a"), add_entry(tar, "b", tarfile.LNKTYPE, "a")), "hard link entries are not allowed"),
    "device": (lambda tar, outside: add_entry(tar, "dev/sda", tarfile.BLKTYPE), "device entries are not allowed"),
    "fifo": (lambda tar, outside: add_entry(tar, "run/fifo", tarfile.FIFOTYPE), "FIFO entries are not allowed"),
    "duplicate": (lambda tar, outside: (add_file(tar, "etc/hosts"), add_file(tar, "etc/hosts")), "duplicate entry"),
    "file-over-directory": (lambda tar, outside: (add_file(tar, "etc"), add_file(tar, "etc/hosts")), "passes through a non-directory entry"),
    "empty-link-target": (lambda tar, outside: add_entry(tar, "x", tarfile.SYMTYPE, ""), "empty link target"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARCHIVES))
def test_unsafe_members_are_refused(case: str, tmp_path: Path, run_cli: Runner) -> None:
    build, message = BAD_ARCHIVES[case]
    outside = tmp_path / "outside"
    outside.mkdir()
    archive = make_tar(tmp_path / f"{case}.tar.gz", lambda tar: build(tar, str(outside)))
    scratch = tmp_path / "scratch"  # the replay's $TMPDIR: this test's own, not the shared /tmp
    scratch.mkdir()
    result = run_cli("node", "--root", str(archive), "--format", "json", env={"TMPDIR": str(scratch)})
    assert result.returncode == 3, result.stdout
    assert result.stderr.startswith(f"preflight: error: --root {archive}: ") and message in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert list(outside.iterdir()) == [] and not (tmp_path / "escaped").exists()
    assert list(scratch.iterdir()) == []  # the private directory is gone


def test_garbage_and_truncated_archives(tmp_path: Path, run_cli: Runner) -> None:
    good = tmp_path / "good.tar.gz"
    take_snapshot(SnapshotArgs(output=str(good), root=str(EXAMPLE_ROOT)))
    data = good.read_bytes()
    cases = {
        "garbage.tar.gz": (b"this is not an archive\n" * 100, "neither a directory nor a snapshot archive"),
        "empty.tar.gz": (b"", "neither a directory nor a snapshot archive"),
        "truncated.tar.gz": (data[: len(data) // 2], "corrupt or truncated archive"),
        "gzip-header-only.tar.gz": (data[:20], "archive"),
        "flipped.tar.gz": (data[:200] + bytes(b ^ 0xFF for b in data[200:400]) + data[400:], "archive"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        result = run_cli("node", "--root", str(path))
        assert result.returncode == 3, name
        assert result.stderr.startswith(f"preflight: error: --root {path}: ") and message in result.stderr, (name, result.stderr)
        assert "Traceback" not in result.stderr


def test_member_count_and_size_are_capped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    many = make_tar(tmp_path / "many.tar.gz", lambda tar: [add_file(tar, f"proc/{i}/comm") for i in range(50)])
    big = make_tar(tmp_path / "big.tar.gz", lambda tar: add_file(tar, "etc/big", b"\0" * 4096))
    monkeypatch.setattr(archive_module, "MAX_MEMBERS", 20)
    monkeypatch.setattr(archive_module, "MAX_TOTAL_BYTES", 1024)
    for archive, message in ((many, "more than 20 members"), (big, "uncompressed; refusing")):
        with pytest.raises(ArchiveError, match=message):
            with opened_root(str(archive)):
                pass


def test_absolute_link_targets_stay_inside_the_root(tmp_path: Path) -> None:
    """An absolute target means a path of the recorded node: extracted as is, and preflight's
    filesystem view resolves it under the root, never on this machine."""
    archive = make_tar(tmp_path / "links.tar.gz", lambda tar: (
        add_file(tar, "run/systemd/resolve/stub-resolv.conf", b"nameserver 10.9.9.9\n"),
        add_entry(tar, "etc/resolv.conf", tarfile.SYMTYPE, "/run/systemd/resolve/stub-resolv.conf"),
        add_entry(tar, "etc/passwd", tarfile.SYMTYPE, "/etc/shadow"),
    ))
    from preflight.sources import NodeFS, NotCaptured

    with opened_root(str(archive)) as (directory, _):
        fs = NodeFS(directory)
        assert fs.read("/etc/resolv.conf") == "nameserver 10.9.9.9\n"
        with pytest.raises(NotCaptured):  # /etc/shadow of the snapshot, which it does not hold
            fs.read("/etc/passwd")
        assert fs.readlink("/etc/resolv.conf") == "/run/systemd/resolve/stub-resolv.conf"


def test_extraction_needs_an_empty_private_directory(tmp_path: Path) -> None:
    archive = make_tar(tmp_path / "one.tar.gz", lambda tar: add_file(tar, "etc/hosts"))
    target = tmp_path / "target"
    target.mkdir()
    extract_archive(str(archive), str(target))
    assert (target / "etc" / "hosts").read_text() == "x\n"
    with pytest.raises(ArchiveError, match="duplicate entry"):
        extract_archive(str(archive), str(target))  # never overwrites what is there
