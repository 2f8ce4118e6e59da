"""Snapshot archives from someone else are bounded before they are parsed: header records (GNU
long names, pax headers), depth, time; clean-up survives any tree and a SIGTERM. Each case is
an attack that used to work (a 1 MB archive drove a replay to 4.2 GB, 1,100 nested directories
crashed clean-up, --timeout did not cover unpacking, SIGTERM left the unpacked tree behind)."""

from __future__ import annotations

import gzip
import io
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from preflight.sources.archive import ArchiveError, extract_archive, remove_tree

from conftest import EXAMPLE_ROOT, Runner, preflight_command
from reliability_harness import hang_nvml


def header(name: bytes, size: int, kind: bytes) -> bytes:
    """One ustar header block, checksummed: enough to describe any entry by hand."""
    block = bytearray(512)
    block[0:len(name)] = name
    block[100:108] = b"0000644\0"
    block[124:136] = f"{size:011o}\0".encode()
    block[156:157] = kind
    block[257:263] = b"ustar\0"
    block[263:265] = b"00"
    block[148:156] = b" " * 8
    block[148:156] = f"{sum(block):06o}\0 ".encode()
    return bytes(block)


def gz(path: Path, *chunks: bytes) -> Path:
    with gzip.open(path, "wb", compresslevel=1) as out:
        for chunk in chunks:
            out.write(chunk)
    return path


def extract(archive: Path, tmp_path: Path, deadline: float | None = None) -> Path:
    target = tmp_path / "out"
    target.mkdir(parents=True, exist_ok=True)
    extract_archive(str(archive), str(target), deadline)
    return target


def test_a_huge_gnu_long_name_is_refused_before_it_is_read(tmp_path: Path) -> None:
    # The header claims a 1 GiB name; the archive itself is a few hundred bytes.
    archive = gz(tmp_path / "longname.tar.gz", header(b"././@LongLink", 1 << 30, b"L"), b"a" * 4096)
    with pytest.raises(ArchiveError, match="GNU long name of 1073741824 bytes"):
        extract(archive, tmp_path)


def test_a_huge_pax_header_is_refused_and_memory_stays_flat(tmp_path: Path) -> None:
    # 256 MiB of pax records behind a header that announces them: under 1 MB compressed.
    archive = tmp_path / "pax.tar.gz"
    with gzip.open(archive, "wb", compresslevel=1) as out:
        out.write(header(b"PaxHeader", 256 << 20, b"x"))
        for _ in range(256):
            out.write(b"9 path=a\n" * 116_508 + b"\n" * 4)  # 1 MiB of records
    assert archive.stat().st_size < 4 << 20
    code = (
        "import sys\n"
        "from preflight.sources.archive import ArchiveError, extract_archive\n"
        "try:\n    extract_archive(sys.argv[1], sys.argv[2])\nexcept ArchiveError as e:\n    print(e)\n"
        # VmHWM, not ru_maxrss: Linux keeps the parent's ru_maxrss across fork and exec
        "print(next(line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM')))\n"
    )
    (tmp_path / "o").mkdir()
    result = subprocess.run([sys.executable, "-c", code, str(archive), str(tmp_path / "o")], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    message, peak_kib = result.stdout.strip().splitlines()
    assert "pax header of 268435456 bytes" in message
    assert int(peak_kib) < 200 * 1024  # the interpreter and preflight: no 1 GiB buffer


@pytest.mark.parametrize("size", ["-1000000000000", "+5", "0x10", " 7"])
def test_a_pax_size_that_is_not_plain_digits_is_refused(tmp_path: Path, size: str) -> None:
    """A negative size would lower the running total, and with it the extraction cap."""
    line = f" size={size}\n"
    length = len(line) + len(str(len(line)))  # a pax record counts its own length digits
    length += len(str(length)) - len(str(len(line)))
    record = f"{length}{line}"
    assert len(record) == length
    body = record.encode().ljust(512, b"\0")
    archive = gz(tmp_path / "neg.tar.gz", header(b"PaxHeader", len(record), b"x"), body, header(b"sys/x", 0, b"0"), b"\0" * 1024)
    with pytest.raises(ArchiveError, match="size that is not a number"):
        extract(archive, tmp_path)


def test_a_tar_size_field_with_a_sign_is_refused(tmp_path: Path) -> None:
    block = bytearray(header(b"sys/x", 0, b"0"))
    block[124:136] = b"-0000000777\0"
    block[148:156] = b"        "
    block[148:156] = f"{sum(block):06o}\0 ".encode()
    with pytest.raises(ArchiveError, match="size is not a number"):
        extract(gz(tmp_path / "sign.tar.gz", bytes(block), b"\0" * 1024), tmp_path)


def test_names_from_pax_and_gnu_records_are_used_and_checked(tmp_path: Path) -> None:
    long_name = "sys/" + "d/" * 40 + "value"
    path = tmp_path / "pax-ok.tar.gz"
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(long_name)
        info.size = 3
        tar.addfile(info, io.BytesIO(b"42\n"))
    assert (extract(path, tmp_path) / long_name).read_text() == "42\n"
    traversal = tmp_path / "gnu-traversal.tar.gz"
    with tarfile.open(traversal, "w:gz", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("../" * 40 + "escaped")
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(ArchiveError, match="'..' in its path"):
        extract(traversal, tmp_path / "t")


def test_deep_nesting_is_refused_and_cleaned_up(tmp_path: Path, run_cli: Runner) -> None:
    path = tmp_path / "deep.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for depth in range(1, 1101):
            info = tarfile.TarInfo("/".join(["d"] * depth))
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    result = run_cli("node", "--root", str(path), env={"TMPDIR": str(scratch)})  # run_cli's timeout bounds it
    assert result.returncode == 3 and "deeper than 64 directories" in result.stderr and "Traceback" not in result.stderr
    assert list(scratch.iterdir()) == []  # nothing left behind


def test_clean_up_removes_any_depth_without_recursion(tmp_path: Path) -> None:
    top = tmp_path / "top"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(3000):  # past Python's recursion limit, PATH_MAX and the descriptor limit
        os.mkdir("d", dir_fd=fd)
        deeper = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = deeper
    os.close(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    os.close(fd)
    os.symlink("/etc", top / "link-out")  # removed as a link, never followed
    remove_tree(str(top))
    assert not top.exists() and Path("/etc/hostname").exists()


def test_unpacking_counts_against_the_timeout(tmp_path: Path, run_cli: Runner) -> None:
    path = tmp_path / "wide.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for index in range(50_000):
            info = tarfile.TarInfo(f"sys/d{index}")
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    result = run_cli("node", "--root", str(path), "--timeout", "0.5", env={"TMPDIR": str(scratch)})
    assert result.returncode == 3 and "did not finish within the --timeout" in result.stderr, result.stderr
    assert list(scratch.iterdir()) == []
    with pytest.raises(ArchiveError, match="--timeout"):
        extract(path, tmp_path, deadline=time.monotonic())


def test_sigterm_during_a_replay_removes_the_unpacked_snapshot(tmp_path: Path) -> None:
    root = tmp_path / "node"
    shutil.copytree(EXAMPLE_ROOT, root, symlinks=True)
    hang_nvml(root)  # the replay then waits in NVML until the signal comes
    archive = tmp_path / "node.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for entry in sorted(root.rglob("*")):
            tar.add(entry, arcname=str(entry.relative_to(root)), recursive=False)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    process = subprocess.Popen(
        [*preflight_command(), "node", "--root", str(archive), "--timeout", "30"],
        env={**os.environ, "TMPDIR": str(scratch)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 20
    while not any(scratch.glob("preflight-replay-*/*/sys")) and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.01)
    assert process.poll() is None, "the replay ended before the signal"
    time.sleep(0.3)  # inside the engine, waiting on the hung NVML call
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=30)
    assert process.returncode != 0
    assert list(scratch.iterdir()) == []
