"""Conformance: every check in the registry has a present and an absent case under
``tests/cases/<ID>/``, each built from a recorded root of this repository and decided by the
check as the case says (see tests/cases/_case.py for the format)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cases._case import (
    CASES,
    VERDICTS,
    CaseError,
    VerdictMismatch,
    check_case,
    known_bases,
    load_case,
    materialise,
)
from preflight.discovery import build_registry

REGISTRY_IDS = sorted(build_registry(plugins=False).checks)
CASE_ENTRIES = {"case.toml", "root", "config.toml"}
EXAMPLE = "examples/nodes/hgx-h100"


@pytest.mark.parametrize("verdict", VERDICTS)
@pytest.mark.parametrize("ref_id", REGISTRY_IDS)
def test_reference_case(ref_id: str, verdict: str, tmp_path: Path) -> None:
    try:
        check_case(CASES / ref_id / verdict, ref_id, verdict, tmp_path)
        return
    except CaseError as error:
        problem = str(error)
    pytest.fail(problem, pytrace=False)  # outside the handler: one line, no chained traceback


def test_no_case_without_a_check() -> None:
    """A case directory for an ID no check decides (a typo, a renamed ID) would never run."""
    stray = []
    for entry in sorted(CASES.iterdir()):
        if entry.name.startswith(("_", ".")):
            continue
        if entry.name not in REGISTRY_IDS:
            stray.append(entry.name)
            continue
        stray += [f"{entry.name}/{sub.name}" for sub in entry.iterdir() if sub.name not in VERDICTS]
        for verdict in VERDICTS:
            if (entry / verdict).is_dir():
                stray += [f"{entry.name}/{verdict}/{item.name}" for item in (entry / verdict).iterdir() if item.name not in CASE_ENTRIES]
    assert stray == []


def _case_dir(parent: Path, ref_id: str, verdict: str, text: str) -> Path:
    directory = parent / "cases" / ref_id / verdict
    directory.mkdir(parents=True)
    (directory / "case.toml").write_text(text)
    return directory


def test_a_wrong_absent_case_fails(tmp_path: Path) -> None:
    """The example node's slurmd runs with an 8 MiB memlock limit, so MEM001 is present there:
    a case claiming it absent must fail the verdict, or the conformance test could never fail."""
    directory = _case_dir(tmp_path, "MEM001", "absent", f'base = "{EXAMPLE}"\nwhy = "wrong on purpose"\n')
    with pytest.raises(VerdictMismatch, match=r"expected absent, got .*present"):
        check_case(directory, "MEM001", "absent", tmp_path)


def test_a_wrong_present_case_fails(tmp_path: Path) -> None:
    """Every GPU of the example node has its persistence mode on: GPU001 is absent there."""
    directory = _case_dir(tmp_path, "GPU001", "present", f'base = "{EXAMPLE}"\nwhy = "wrong on purpose"\n')
    with pytest.raises(VerdictMismatch, match=r"expected present, got node: absent"):
        check_case(directory, "GPU001", "present", tmp_path)


def test_a_missing_case_is_reported(tmp_path: Path) -> None:
    with pytest.raises(CaseError, match=r"MEM001: no absent case"):
        check_case(tmp_path / "MEM001" / "absent", "MEM001", "absent", tmp_path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('base = "examples/nodes/hgx-h100"\nwhy = "x"\nwhy = "y"\n', "not valid TOML"),
        ('base = "examples/nodes/hgx-h100"\nwhy = "x"\nbasis = "typo"\n', r"unknown key\(s\) basis"),
        ('base = "examples/nodes/no-such-node"\nwhy = "x"\n', "is not a recorded root"),
        ('base = "examples/nodes/../nodes/hgx-h100"\nwhy = "x"\n', "is not a recorded root"),
        ('base = "/"\nwhy = "x"\n', "is not a recorded root"),
        ('why = "x"\n', "base None is not a recorded root"),
        ('base = "examples/nodes/hgx-h100"\n', "'why' must be"),
        ('base = "examples/nodes/hgx-h100"\nwhy = "x"\nremove = "etc/hosts"\n', "'remove' must be a list"),
        ('base = "examples/nodes/hgx-h100"\nwhy = "x"\nremove = ["/etc/hosts"]\n', "must be relative"),
        ('base = "examples/nodes/hgx-h100"\nwhy = "x"\nremove = ["etc/../../x"]\n', "must not contain '..'"),
        ('base = "examples/nodes/hgx-h100"\nwhy = "x"\n[environ]\nNCCL_DEBUG = 1\n', "expected a string"),
    ],
)
def test_a_malformed_case_is_reported(tmp_path: Path, text: str, message: str) -> None:
    directory = _case_dir(tmp_path, "MEM001", "present", text)
    with pytest.raises(CaseError, match=message):
        load_case(directory, "MEM001", "present")


def test_a_stale_remove_is_reported(tmp_path: Path) -> None:
    """A path to remove that the base no longer has means the case no longer says what it tests."""
    directory = _case_dir(tmp_path, "MEM001", "present", f'base = "{EXAMPLE}"\nwhy = "x"\nremove = ["etc/no-such-file"]\n')
    case = load_case(directory, "MEM001", "present")
    with pytest.raises(CaseError, match=r"remove 'etc/no-such-file': not in examples/nodes/hgx-h100"):
        materialise(case, tmp_path / "root")


def test_materialise_removes_overlays_and_replaces_the_environment(tmp_path: Path) -> None:
    directory = _case_dir(
        tmp_path, "MEM001", "present",
        f'base = "{EXAMPLE}"\nwhy = "x"\nremove = ["etc/nccl.conf"]\n[environ]\nNCCL_DEBUG = "INFO"\nA = "b=c"\n',
    )
    (directory / "root" / "etc").mkdir(parents=True)
    (directory / "root" / "etc" / "hostname").write_text("case-node\n")
    base = known_bases()[EXAMPLE]
    recorded_hostname = (base / "etc" / "hostname").read_text()

    root = materialise(load_case(directory, "MEM001", "present"), tmp_path / "root")

    assert not (root / "etc" / "nccl.conf").exists()
    assert (base / "etc" / "nccl.conf").exists()  # the repository's root is never touched
    assert (root / "etc" / "hostname").read_text() == "case-node\n"
    assert (base / "etc" / "hostname").read_text() == recorded_hostname
    assert (root / "proc" / "self" / "environ").read_bytes() == b"NCCL_DEBUG=INFO\0A=b=c\0"
    # Unchanged files come from the base, symlinks kept as links.
    assert (root / "etc" / "hosts").read_bytes() == (base / "etc" / "hosts").read_bytes()
    links = [path for path in base.rglob("*") if path.is_symlink()]
    assert links and all((root / link.relative_to(base)).is_symlink() for link in links)
