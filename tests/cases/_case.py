"""Per-reference cases: load one ``tests/cases/<ID>/{present,absent}/`` set, build its node root
and decide that one reference on it.

A case directory holds ``case.toml`` (``base``: a recorded root of this repository, ``why``: the
decisive fact in one sentence, optional ``remove``: paths deleted from the copy, optional
``[environ]``: the job environment that replaces the root's ``proc/self/environ``), an optional
``root/`` overlay copied over the base, and an optional ``config.toml`` passed as the site
configuration. Everything is materialised into a directory the caller owns (pytest's
``tmp_path``), never into the repository.

The run itself is one function, :func:`run_case`, so that it can be swapped for whatever assembles
a node run (today the engine's public pieces, as ``preflight node`` uses them).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from preflight.config import HostConfig, parse_config
from preflight.discovery import build_registry
from preflight.engine import RunOptions, run, select_checks
from preflight.sources import SourceError, Sources, open_root
from preflight.tomlcompat import TomlError, parse_toml

CASES = Path(__file__).resolve().parent
REPO = CASES.parent.parent
#: Where a case's ``base`` may come from: the recorded roots kept (and generated) in this repository.
BASE_PARENTS = ("examples/nodes", "tests/fixtures/nodes")
VERDICTS = ("present", "absent")
CASE_KEYS = frozenset({"base", "why", "remove", "environ"})
# A shared two-core machine can be slow; a probe timing out would turn a verdict into "unknown"
# and make the case fail for a reason that has nothing to do with the check.
RUN_TIMEOUT_S = 300.0


class CaseError(Exception):
    """The case itself is wrong (missing, malformed, unknown base); the message is one line."""


class VerdictMismatch(AssertionError):
    """The check decided the case otherwise than the case says."""


@dataclass(frozen=True)
class Case:
    ref_id: str
    verdict: str  # "present" or "absent"
    directory: Path
    base: Path
    why: str
    remove: tuple[str, ...]
    environ: dict[str, str] | None  # None: keep the base's recorded environment
    overlay: Path | None
    config: Path | None


def known_bases() -> dict[str, Path]:
    """Repository-relative name -> directory of every recorded root a case may start from."""
    bases: dict[str, Path] = {}
    for parent in BASE_PARENTS:
        for entry in sorted((REPO / parent).iterdir()):
            if entry.is_dir() and not entry.is_symlink() and not entry.name.startswith(("_", ".")):
                bases[f"{parent}/{entry.name}"] = entry
    return bases


def _relative_path(value: Any, where: str) -> str:
    """A path inside the node root: relative, no ``..``, not empty."""
    if not isinstance(value, str) or not value.strip("/"):
        raise CaseError(f"{where}: expected a non-empty path string, got {value!r}")
    parts = Path(value).parts
    if value.startswith("/") or ".." in parts:
        raise CaseError(f"{where}: {value!r} must be relative to the root and must not contain '..'")
    return value


def _environ(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise CaseError(f"{where}: expected a table of NAME = \"value\"")
    environ: dict[str, str] = {}
    for name, text in value.items():
        if not name or "=" in name or "\0" in name:
            raise CaseError(f"{where}: {name!r} is not an environment variable name")
        if not isinstance(text, str) or "\0" in text:
            raise CaseError(f"{where}.{name}: expected a string without NUL, got {text!r}")
        environ[name] = text
    return environ


def load_case(directory: Path, ref_id: str, verdict: str) -> Case:
    """The case in ``directory``; CaseError when it is missing or malformed."""
    if verdict not in VERDICTS:
        raise CaseError(f"{directory}: verdict {verdict!r} is neither of {', '.join(VERDICTS)}")
    toml_path = directory / "case.toml"
    if not toml_path.is_file():
        raise CaseError(f"{ref_id}: no {verdict} case ({toml_path} is missing)")
    try:
        data = parse_toml(toml_path.read_text(encoding="utf-8"))
    except (TomlError, UnicodeDecodeError) as error:
        raise CaseError(f"{toml_path}: not valid TOML: {error}") from None
    unknown = sorted(set(data) - CASE_KEYS)
    if unknown:
        raise CaseError(f"{toml_path}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(CASE_KEYS))})")
    base_name = data.get("base")
    bases = known_bases()
    if not isinstance(base_name, str) or base_name.rstrip("/") not in bases:
        raise CaseError(
            f"{toml_path}: base {base_name!r} is not a recorded root of this repository "
            f"({' or '.join(p + '/*' for p in BASE_PARENTS)})"
        )
    why = data.get("why")
    if not isinstance(why, str) or not why.strip():
        raise CaseError(f"{toml_path}: 'why' must be one non-empty sentence naming the decisive fact")
    remove = data.get("remove", [])
    if not isinstance(remove, list):
        raise CaseError(f"{toml_path}: 'remove' must be a list of paths")
    environ = _environ(data["environ"], f"{toml_path}: [environ]") if "environ" in data else None
    overlay = directory / "root"
    config = directory / "config.toml"
    return Case(
        ref_id=ref_id,
        verdict=verdict,
        directory=directory,
        base=bases[base_name.rstrip("/")],
        why=why.strip(),
        remove=tuple(_relative_path(item, f"{toml_path}: remove") for item in remove),
        environ=environ,
        overlay=overlay if overlay.is_dir() else None,
        config=config if config.is_file() else None,
    )


def _inside(target: Path, path: Path, what: str) -> Path:
    """``path`` with its parent's symlinks resolved, which must stay inside ``target``: sysfs-style
    links inside the copy are followed (an overlay may write through ``sys/class/...``), links out
    of it are refused."""
    resolved = path.parent.resolve() / path.name
    if not resolved.is_relative_to(target.resolve()):
        raise CaseError(f"{what}: {path.relative_to(target)} leads outside the root ({resolved})")
    return resolved


def _apply_overlay(overlay: Path, target: Path) -> None:
    for directory, subdirs, files in os.walk(overlay):
        here = Path(directory)
        # os.walk lists symlinks to directories among subdirs; they are copied as links, not entered.
        for name in [*files, *(d for d in subdirs if (here / d).is_symlink())]:
            source = here / name
            destination = _inside(target, target / source.relative_to(overlay), f"{overlay}")
            destination.parent.mkdir(parents=True, exist_ok=True)
            if destination.is_symlink() or destination.is_file():
                destination.unlink()  # replace the entry itself, never write through a link
            elif destination.is_dir():
                shutil.rmtree(destination)
            if source.is_symlink():
                destination.symlink_to(os.readlink(source))
            else:
                shutil.copyfile(source, destination)
        subdirs[:] = [d for d in subdirs if not (here / d).is_symlink()]


def materialise(case: Case, target: Path) -> Path:
    """Build the case's node root at ``target`` (which must not exist yet) and return it."""
    shutil.copytree(case.base, target, symlinks=True)
    for item in case.remove:
        path = _inside(target, target / item, f"{case.directory}/case.toml: remove")
        if not os.path.lexists(path):
            # A stale case: the base changed and the case no longer says what it removes.
            raise CaseError(f"{case.directory}/case.toml: remove {item!r}: not in {case.base.relative_to(REPO)}")
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    if case.overlay is not None:
        _apply_overlay(case.overlay, target)
    if case.environ is not None:
        environ = _inside(target, target / "proc/self/environ", f"{case.directory}/case.toml: [environ]")
        environ.parent.mkdir(parents=True, exist_ok=True)
        if environ.is_symlink():
            environ.unlink()
        environ.write_bytes(b"".join(f"{name}={value}\0".encode() for name, value in case.environ.items()))
    return target


def _hostname(root: Path) -> str:
    """The recorded node's hostname, as ``preflight node`` reads it (host sections of a config)."""
    try:
        text = open_root(str(root)).read("/proc/sys/kernel/hostname")
    except SourceError:
        text = None
    return (text or "").strip() or "unknown"


def run_case(root: Path, ref_id: str, config: Path | None) -> list[dict[str, Any]]:
    """Decide only ``ref_id`` on ``root`` in the full profile; the findings as report JSON.

    Built-in checks only (no plugins of the environment), and a config only when the case has
    one: the machine's own /etc/preflight must not change a case's verdict."""
    fs = open_root(str(root))
    hostname = _hostname(root)
    host_config = parse_config(config.read_text(encoding="utf-8"), str(config), hostname) if config else HostConfig()
    registry = build_registry(plugins=False, profile="full")
    options = RunOptions(profile="full", select=(ref_id,), timeout_s=RUN_TIMEOUT_S, probe_timeout_s=RUN_TIMEOUT_S)
    # --select matches ID prefixes; a case decides exactly its own ID.
    checks = [(spec, reference) for spec, reference in select_checks(registry, host_config, options) if reference.id == ref_id]
    if not checks:
        raise CaseError(f"{ref_id}: no check decides it in the full profile (or the case's config disables it)")
    report = run(registry, Sources.for_fs(fs, host_config.dns), host_config, options, hostname, checks)
    return [finding for finding in report.to_json()["findings"] if finding["id"] == ref_id]


def verdict_problem(findings: list[dict[str, Any]], verdict: str) -> str | None:
    """Why ``findings`` do not give ``verdict`` (None when they do). Present: at least one finding
    present. Absent: exactly the single absent verdict."""
    statuses = [f"{finding['subject']}: {finding['status']}" + (f" ({finding['reason']})" if finding["reason"] else "") for finding in findings]
    if verdict == "present" and any(finding["status"] == "present" for finding in findings):
        return None
    if verdict == "absent" and [finding["status"] for finding in findings] == ["absent"]:
        return None
    return f"expected {verdict}, got " + ("; ".join(statuses) or "no finding")


def check_case(directory: Path, ref_id: str, verdict: str, work: Path) -> Case:
    """Load, materialise under ``work`` and run one case; VerdictMismatch when the check decides
    otherwise, CaseError when the case itself is broken."""
    case = load_case(directory, ref_id, verdict)
    root = materialise(case, work / "root")
    problem = verdict_problem(run_case(root, ref_id, case.config), verdict)
    if problem is not None:
        raise VerdictMismatch(f"{ref_id} {verdict} case ({case.why}): {problem}")
    return case
