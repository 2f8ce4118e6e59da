"""HVD001: which framework extensions the installed Horovod was built with, read from files only."""

from __future__ import annotations

from pathlib import Path

import pytest

from preflight.checks.hvd import horovod_build_or_launch_misconfigured
from preflight.model import NotApplicable, Observation, Severity, Status, Unknown
from preflight.probes.frameworks import probe_frameworks
from preflight.probes.horovod import HorovodFacts, extension_file, probe_horovod
from preflight.sources import NodeFS

SITE = "usr/local/lib/python3.10/dist-packages"
TORCH_EXT = "mpi_lib_v2.cpython-310-x86_64-linux-gnu.so"
TF_EXT = "mpi_lib.cpython-310-x86_64-linux-gnu.so"


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        ([TORCH_EXT, "__init__.py"], TORCH_EXT),
        (["mpi_lib_v2.so"], "mpi_lib_v2.so"),
        (["mpi_lib_v2.cpython-38-x86_64-linux-gnu.so"], None),  # built for another Python
        (["mpi_lib_v2.cpython-3100-x86_64-linux-gnu.so"], None),  # not 3.10's tag
        (["mpi_lib.cpython-310-x86_64-linux-gnu.so"], None),  # TensorFlow's module name
        (["__init__.py", "mpi_ops.py"], None),
    ],
)
def test_extension_file_follows_the_sites_python(entries: list[str], expected: str | None) -> None:
    assert extension_file(entries, "mpi_lib_v2", f"/{SITE}") == expected


def install(root: Path, *frameworks: str, extensions: tuple[tuple[str, str], ...] = ()) -> None:
    """A site with Horovod 0.28.1, the given frameworks' metadata and Horovod's subpackages."""
    site = root / SITE
    for name, version in (("horovod", "0.28.1"), *((f, "2.6.0") for f in frameworks)):
        meta = site / f"{name}-{version}.dist-info"
        meta.mkdir(parents=True)
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\n")
    for sub in ("torch", "tensorflow", "mxnet", "common"):
        (site / "horovod" / sub).mkdir(parents=True, exist_ok=True)
        (site / "horovod" / sub / "__init__.py").write_text("")
    for sub, name in extensions:
        (site / "horovod" / sub / name).write_bytes(b"\x7fELF")


def judge(root: Path) -> list[Observation]:
    fs = NodeFS(str(root))
    return list(horovod_build_or_launch_misconfigured(probe_horovod(fs, probe_frameworks(fs))))


def verdicts(observations: list[Observation]) -> dict[str, Severity | Status | None]:
    return {o.subject.rsplit(" ", 1)[-1]: (o.status if o.status is Status.UNKNOWN else o.severity) for o in observations}


def test_torch_extension_built_is_absent(tmp_path: Path) -> None:
    install(tmp_path, "torch", extensions=(("torch", TORCH_EXT),))
    assert judge(tmp_path) == []


def test_no_extension_for_the_only_framework_is_an_error(tmp_path: Path) -> None:
    install(tmp_path, "torch")
    found = judge(tmp_path)
    assert verdicts(found) == {"torch": None}  # None: the reference's severity, error
    assert found[0].evidence[-1].source.endswith("/horovod/torch")


def test_one_framework_built_and_another_not_is_a_warning(tmp_path: Path) -> None:
    install(tmp_path, "torch", "tensorflow", extensions=(("tensorflow", TF_EXT),))
    assert verdicts(judge(tmp_path)) == {"torch": Severity.WARNING}


def test_unlisted_package_is_unknown_not_present(tmp_path: Path) -> None:
    install(tmp_path, "torch")
    for path in sorted((tmp_path / SITE / "horovod").rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    (tmp_path / SITE / "horovod").rmdir()  # metadata without its package: a partial copy
    assert verdicts(judge(tmp_path)) == {"(/usr/local/lib/python3.10/dist-packages/horovod)": Status.UNKNOWN}


def test_without_horovod_or_a_framework_beside_it(tmp_path: Path) -> None:
    with pytest.raises(NotApplicable):
        list(horovod_build_or_launch_misconfigured(HorovodFacts((), ())))
    with pytest.raises(Unknown):
        list(horovod_build_or_launch_misconfigured(HorovodFacts((), (), "/usr/lib/python3/dist-packages: permission denied")))
    install(tmp_path)  # Horovod alone: nothing it could have been built for
    assert judge(tmp_path) == []
