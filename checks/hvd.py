"""Horovod builds (HVD references)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from preflight.model import Evidence, NotApplicable, Observation, Severity, Unknown, present, undecided
from preflight.probes.horovod import EXTENSIONS, HorovodFacts, HorovodInstall
from preflight.registry import check

if TYPE_CHECKING:
    from collections.abc import Iterator


def _install_findings(install: HorovodInstall) -> Iterator[Observation]:
    subject = f"Horovod {install.version} ({install.package})"
    if not install.extensions:
        return  # no framework it builds for beside it (another site, or one we do not know)
    if not install.package_listed:
        yield undecided(subject, f"{install.package}: not readable or not captured beside {install.metadata}")
        return
    undecidable = [ext for ext in install.extensions if ext.listed is not True]
    for ext in undecidable:
        yield undecided(f"{subject} {ext.framework}", f"{ext.directory}: not listed (absent, unreadable or not captured)")
    missing = [ext for ext in install.extensions if ext.listed is True and ext.extension is None]
    built = [ext for ext in install.extensions if ext.extension is not None]
    for ext in missing:
        module = EXTENSIONS[ext.framework][1]
        # With no extension at all Horovod is unusable from every framework it sits beside: the
        # reference's error. With another framework's extension built, a job may use only that one.
        severity = None if not built and not undecidable else Severity.WARNING
        yield present(
            f"{subject} {ext.framework}",
            Evidence(install.metadata, f"Horovod {install.version}"),
            Evidence(ext.framework_metadata, f"{ext.framework} installed in the same environment"),
            Evidence(ext.directory, f"no {module} extension module", f"{module}<EXT_SUFFIX>, built when Horovod was installed"),
            severity=severity,
        )


# Full profile only: a Horovod build does not change between jobs, and the prolog should not pay
# for a probe that almost every job leaves idle.
@check("HVD001")
def horovod_build_or_launch_misconfigured(horovod: HorovodFacts) -> Iterator[Observation]:
    """A Horovod installed beside PyTorch, TensorFlow or MXNet without that framework's compiled
    extension module, so importing horovod.<framework> fails."""
    if not horovod.installs and horovod.installs_unknown:
        raise Unknown(horovod.installs_unknown)
    if not horovod.installs:
        raise NotApplicable("Horovod is not installed in this node's Python environments")
    for install in horovod.installs:
        yield from _install_findings(install)
