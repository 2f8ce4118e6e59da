"""AWS Elastic Fabric Adapter (EFA references)."""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING

from preflight.model import (
    Evidence,
    NotApplicable,
    Observation,
    Severity,
    Unknown,
    present,
    undecided,
)
from preflight.probes.efa import PLUGIN_PREFIX, EfaFacts
from preflight.probes.rdma import IB_CLASS, RdmaFacts, require_rdma
from preflight.registry import check

if TYPE_CHECKING:
    from collections.abc import Iterator

    from preflight.probes.job import JobFacts, Setting

LIBFABRIC = "libfabric.so.1"


# NCCL_NET values that name NCCL's built-in transports instead of a plugin (strcasecmp).
BUILTIN_NETS = ("socket", "ib")


def plugin_names(setting: Setting | None) -> list[str] | None:
    """The file names NCCL tries for its net plugin; ``None`` when plugins are disabled."""
    if setting is None:
        return [f"{PLUGIN_PREFIX}.so"]
    if setting.value.strip().lower() == "none":
        return None
    names = []
    for item in setting.value.split(","):
        if not item:
            continue
        names.append(item)
        if "/" not in item and not (item.startswith("lib") and item.endswith(".so")):
            names.append(f"{PLUGIN_PREFIX}-{item}.so")
    return names


def _where(setting: Setting, name: str) -> str:
    return f"{'/proc/self/environ' if setting.origin == 'environment' else setting.origin} {name}"


def _found(efa: EfaFacts, names: list[str]) -> list[str]:
    """The plugin files NCCL would open: a bare name where the loader searches, a path as named."""
    wanted = {posixpath.basename(name) for name in names if "/" not in name}
    absolute = {name for name in names if name.startswith("/")}
    searched = {folder.rstrip("/") for folder in efa.loader_dirs or efa.library_dirs}
    return [
        path for path in efa.libraries
        if path in absolute or (posixpath.basename(path) in wanted and posixpath.dirname(path) in searched)
    ]


#: Device names the kernel's other RDMA drivers give: never an EFA, whatever the vendor file
#: says. A name from rdma-core's rename policy (``rdmap16s27``) could be either.
_OTHER_DRIVERS = ("mlx", "hfi1", "qib", "irdma", "i40iw", "bnxt_re", "rxe", "siw", "hns", "qedr", "erdma", "mana", "cxgb", "ocrdma", "vmw_pvrdma", "usnic", "ionic")


def efa_allowed(fi_provider: str) -> bool:
    """Whether libfabric's FI_PROVIDER filter lets the efa provider load (ofi_create_filter and
    ofi_apply_filter, libfabric src/fabric.c): a comma-separated list of the providers to use, or
    after a leading '^' of those not to use."""
    negated = fi_provider.startswith("^")
    names = [name.lower() for name in fi_provider[negated:].split(",")]
    return ("efa" not in names) if negated else ("efa" in names)


@check("EFA001", profiles=("prolog",))
def efa_provider_unavailable(rdma: RdmaFacts, efa: EfaFacts | None, job: JobFacts) -> Iterator[Observation]:
    """The job's settings or the node's libraries keep NCCL off the EFA devices."""
    require_rdma(rdma)
    devices = [device.name for device in rdma.devices if device.efa]
    if not devices:
        # A device whose PCI vendor could not be read may be an EFA with a non-"efa" name.
        unread = [
            p for d in rdma.devices if not d.name.startswith(_OTHER_DRIVERS)
            for p in d.problems if p.path in (f"{d.path}/device", f"{d.path}/device/vendor")
        ]
        if unread:
            raise Unknown(f"cannot tell whether {unread[0].path.split('/')[4]} is an EFA: {unread[0]}")
    if not devices or efa is None:
        raise NotApplicable("no EFA devices in /sys/class/infiniband")
    on_node = Evidence(IB_CLASS, f"EFA devices: {', '.join(devices)}")
    provider = job.environ.get("FI_PROVIDER")
    if provider is not None and not efa_allowed(provider):
        yield present("FI_PROVIDER", on_node, Evidence("/proc/self/environ FI_PROVIDER", repr(provider), "efa (or unset)"))
    net = job.nccl("NCCL_NET")
    if net is not None and net.value.strip().lower() in BUILTIN_NETS:
        yield present("NCCL_NET", on_node, Evidence(_where(net, "NCCL_NET"), repr(net.value), "the plugin's name (Libfabric / AWS Libfabric) or unset"))
    plugin_setting = job.nccl("NCCL_NET_PLUGIN")
    names = plugin_names(plugin_setting)
    if names == [] and plugin_setting is not None:
        # NCCL 2.26 and earlier load libnccl-net.so for an empty value; 2.27 reads it as a list of
        # no plugins, as it reads "none" (src/plugin/net.cc at v2.26.2-1 and v2.27.3-1).
        yield undecided(
            "NCCL_NET_PLUGIN",
            f"{_where(plugin_setting, 'NCCL_NET_PLUGIN')} is set but empty: NCCL 2.26 and earlier then load libnccl-net.so, "
            "2.27 and later load no plugin, so EFA's plugin depends on the job's NCCL",
        )
    elif names is None and plugin_setting is not None:
        yield present("NCCL_NET_PLUGIN", on_node, Evidence(_where(plugin_setting, "NCCL_NET_PLUGIN"), repr(plugin_setting.value), "aws-ofi-nccl's library (or unset)"))
    elif names is not None and not _found(efa, names) and efa.problems:
        yield undecided("aws-ofi-nccl", f"no {', '.join(names)} found, but: {efa.problems[0]}")
    elif names is not None and not _found(efa, names):
        yield present(
            "aws-ofi-nccl",
            on_node,
            Evidence(", ".join(efa.library_dirs), f"none of {', '.join(names)}", "aws-ofi-nccl (libnccl-net.so or libnccl-net-ofi.so)"),
            severity=Severity.WARNING,
        )
    if not any(posixpath.basename(path).startswith("libfabric.so") for path in efa.libraries):
        if efa.problems:
            yield undecided("libfabric", f"no {LIBFABRIC} found, but: {efa.problems[0]}")
            return
        yield present(
            "libfabric",
            on_node,
            Evidence(", ".join(efa.library_dirs), f"no {LIBFABRIC}", "libfabric 1.22 or newer with the efa provider"),
            severity=Severity.WARNING,
        )
