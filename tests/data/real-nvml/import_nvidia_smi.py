"""Turn a real ``nvidia-smi -q -x`` dump into the NVML answers preflight replays.

    python3 tests/data/real-nvml/import_nvidia_smi.py DUMP.xml ROOT

writes ``ROOT/.preflight/nvml.json`` (format ``preflight-nvml/1``, see preflight/sources/nvml.py):
a node root that holds nothing but NVML's answers, so every other source is "not captured" and
only the NVML half of each check can decide.

nvidia-smi prints what NVML answered, so each field maps back onto one call. The rules:

* a value the dump states becomes that call's result (sizes printed in MiB become bytes, as NVML
  gives them; nvidia-smi rounds them to whole MiB, so they are exact to a MiB);
* ``N/A`` becomes ``NVML_ERROR_NOT_SUPPORTED``: nvidia-smi prints it when the call is not
  supported on the device (a GPU without ECC, row remapping before Ampere, a GPU outside an NVLink
  fabric);
* a field the dump lacks (an older nvidia-smi, a dump trimmed by whoever published it), a value
  that does not parse (a redacted one), or a group of counters that mixes numbers and ``N/A`` is
  not recorded at all: the replay answers ``NVML_NOT_RECORDED`` and the checks say ``unknown``;
* ``<processes>`` lists every process with a context on the GPU; those whose ``<type>`` has a
  ``C`` (compute, or compute and graphics) are what ``nvmlDeviceGetComputeRunningProcesses``
  answers, graphics-only ones (Xorg) are not. An empty element is an empty list; a dump without
  the element, or with a process it cannot read, records nothing;
* calls nvidia-smi -q does not show (compute capability, NVLink state, P2P status) stay
  unrecorded;
* GPUs get NVML indices in the order the dump lists them, which is the order nvidia-smi asks NVML
  for them. A dump that lists fewer GPUs than ``attached_gpus`` was trimmed: the device count is
  the attached count, and the GPUs it leaves out have no answers.

Only the standard library: the test suite and the survey run it on the corpus.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path
from typing import Any

NOT_SUPPORTED = {"error": "NVML_ERROR_NOT_SUPPORTED", "detail": "nvidia-smi printed N/A"}
MIB = 1 << 20

# nvmlClocksThrottleReason* (nvml.h; renamed nvmlClocksEventReason* with the same values) by the
# suffix of nvidia-smi's clocks_throttle_reason_* / clocks_event_reason_* elements.
THROTTLE_BITS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clocks_setting": 0x100,
}


class Unparsed(ValueError):
    """A stated value this importer cannot read back into NVML's answer."""


def _text(element: ElementTree.Element, path: str) -> str | None:
    found = element.find(path)
    return None if found is None or found.text is None else found.text.strip()


def _answer(value: str | None, parse: Callable[[str], Any]) -> dict[str, Any] | None:
    """The recorded answer for one stated field, or None (not recorded)."""
    if value is None:
        return None
    if value == "N/A":
        return NOT_SUPPORTED
    try:
        return {"result": parse(value)}
    except (Unparsed, ValueError):
        return None


def _switch(value: str) -> int:
    if value in ("Enabled", "Yes"):
        return 1
    if value in ("Disabled", "No"):
        return 0
    raise Unparsed(value)


def _mib(value: str) -> int:
    number, unit = value.split()
    if unit != "MiB":
        raise Unparsed(value)
    return int(number) * MIB


def _cuda(value: str) -> int:
    major, minor = value.split(".")
    return int(major) * 1000 + int(minor) * 10


def _count(value: str) -> int:
    number = int(value)
    if number < 0:
        raise Unparsed(value)
    return number


def _group(element: ElementTree.Element, paths: tuple[str, ...], parse: Callable[[list[str]], Any]) -> dict[str, Any] | None:
    """One call whose answer several fields show together: all N/A is NOT_SUPPORTED, all stated
    is the parsed result, anything else (some missing, some N/A) is not recorded."""
    values = [_text(element, path) for path in paths]
    if any(value is None for value in values):
        return None
    if all(value == "N/A" for value in values):
        return NOT_SUPPORTED
    if any(value == "N/A" for value in values):
        return None
    try:
        return {"result": parse([value for value in values if value is not None])}
    except (Unparsed, ValueError):
        return None


def _pci(gpu: ElementTree.Element) -> dict[str, Any] | None:
    bus_id = _text(gpu, "pci/pci_bus_id") or gpu.get("id")
    if not bus_id:
        return None
    info: dict[str, Any] = {"busId": bus_id}
    for key, path in (("domain", "pci/pci_domain"), ("bus", "pci/pci_bus"), ("device", "pci/pci_device")):
        value = _text(gpu, path)
        try:
            info[key] = int(value, 16) if value else None
        except ValueError:
            info[key] = None
    return {"result": {key: value for key, value in info.items() if value is not None}}


def _remapped_rows(gpu: ElementTree.Element) -> dict[str, Any] | None:
    element = gpu.find("remapped_rows")
    if element is None:
        return None
    if (element.text or "").strip() == "N/A":
        return NOT_SUPPORTED
    paths = ("remapped_row_corr", "remapped_row_unc", "remapped_row_pending", "remapped_row_failure")
    return _group(element, paths, lambda v: [_count(v[0]), _count(v[1]), _switch(v[2]), _switch(v[3])])


def _pages_pending(gpu: ElementTree.Element) -> dict[str, Any] | None:
    """``retired_pages/pending_retirement``: Yes/No as NVML's enable state, N/A as not supported."""
    element = gpu.find("retired_pages/pending_retirement")
    text = (element.text or "").strip() if element is not None else ""
    if text == "N/A":
        return NOT_SUPPORTED
    return {"result": {"Yes": 1, "No": 0}[text]} if text in ("Yes", "No") else None


def _throttle(gpu: ElementTree.Element) -> dict[str, Any] | None:
    for group, prefix in (("clocks_event_reasons", "clocks_event_reason_"), ("clocks_throttle_reasons", "clocks_throttle_reason_")):
        element = gpu.find(group)
        if element is None:
            continue
        states = {child.tag[len(prefix):]: (child.text or "").strip() for child in element if child.tag.startswith(prefix)}
        if not states or any(name not in THROTTLE_BITS for name in states):
            return None  # a reason this importer has no bit for: the mask would be incomplete
        if all(state == "N/A" for state in states.values()):
            return NOT_SUPPORTED
        if any(state not in ("Active", "Not Active") for state in states.values()):
            return None
        return {"result": sum(THROTTLE_BITS[name] for name, state in states.items() if state == "Active")}
    return None


def _uncorrected_volatile(gpu: ElementTree.Element) -> dict[str, Any] | None:
    """NVML's volatile uncorrected ECC total as nvidia-smi shows it: one total (older dumps:
    ``double_bit/total``), or its parts by memory (``sram_uncorrectable``, ``dram_uncorrectable``,
    and in recent dumps the SRAM part split by parity and SEC-DED), summed back."""
    volatile = gpu.find("ecc_errors/volatile")
    if volatile is None:
        return None
    if volatile.find("double_bit/total") is not None:
        return _group(volatile, ("double_bit/total",), lambda v: _count(v[0]))
    parts = tuple(child.tag for child in volatile if "uncorrectable" in child.tag)
    return _group(volatile, parts, lambda v: sum(_count(x) for x in v)) if parts else None


def _fabric(gpu: ElementTree.Element) -> dict[str, Any] | None:
    """Only the answer of a GPU outside any NVLink fabric (state and status N/A) is read back:
    the state and status names of a fabric member are left unrecorded rather than guessed."""
    element = gpu.find("fabric")
    if element is None:
        return None
    if _text(element, "state") == "N/A" and _text(element, "status") == "N/A":
        return NOT_SUPPORTED
    return None


def _compute_processes(gpu: ElementTree.Element) -> dict[str, Any] | None:
    processes = gpu.find("processes")
    if processes is None:
        return None
    listed = []
    for process in processes.findall("process_info"):
        kind, pid = _text(process, "type"), _text(process, "pid")
        if kind is None or pid is None or not pid.isdigit():
            return None
        if "C" in kind:
            used = _text(process, "used_memory")
            try:
                memory = _mib(used) if used is not None else None
            except (Unparsed, ValueError):
                memory = None  # "N/A" under WDDM, which NVML also leaves unset
            listed.append({"pid": int(pid), "usedGpuMemory": memory})
    return {"result": listed}


def _device_calls(gpu: ElementTree.Element) -> dict[str, dict[str, Any] | None]:
    return {
        "nvmlDeviceGetName": _answer(_text(gpu, "product_name"), str),
        "nvmlDeviceGetUUID": _answer(_text(gpu, "uuid"), str),
        "nvmlDeviceGetPciInfo": _pci(gpu),
        "nvmlDeviceGetPersistenceMode": _answer(_text(gpu, "persistence_mode"), _switch),
        "nvmlDeviceGetBAR1MemoryInfo": _group(
            gpu,
            ("bar1_memory_usage/total", "bar1_memory_usage/used", "bar1_memory_usage/free"),
            lambda v: {"bar1Total": _mib(v[0]), "bar1Used": _mib(v[1]), "bar1Free": _mib(v[2])},
        ),
        "nvmlDeviceGetComputeRunningProcesses": _compute_processes(gpu),
        "nvmlDeviceGetEccMode": _group(gpu, ("ecc_mode/current_ecc", "ecc_mode/pending_ecc"), lambda v: [_switch(v[0]), _switch(v[1])]),
        "nvmlDeviceGetMigMode": _group(gpu, ("mig_mode/current_mig", "mig_mode/pending_mig"), lambda v: [_switch(v[0]), _switch(v[1])]),
        "nvmlDeviceGetRemappedRows": _remapped_rows(gpu),
        "nvmlDeviceGetRetiredPagesPendingStatus": _pages_pending(gpu),
        "nvmlDeviceGetCurrentClocksThrottleReasons": _throttle(gpu),
        "nvmlDeviceGetGpuFabricInfo": _fabric(gpu),
    }


def convert(dump: bytes) -> dict[str, Any]:
    """The ``preflight-nvml/1`` document for one ``nvidia-smi -q -x`` dump."""
    log = ElementTree.fromstring(dump)
    if log.tag != "nvidia_smi_log":
        raise ValueError(f"not an nvidia-smi -q -x dump (root element <{log.tag}>)")
    calls: dict[str, Any] = {}
    for function, answer in (
        ("nvmlSystemGetDriverVersion", _answer(_text(log, "driver_version"), str)),
        ("nvmlSystemGetCudaDriverVersion_v2", _answer(_text(log, "cuda_version"), _cuda)),
        ("nvmlDeviceGetCount", _answer(_text(log, "attached_gpus"), _count)),
    ):
        if answer is not None:
            calls[function] = answer
    for index, gpu in enumerate(log.findall("gpu")):
        for function, answer in _device_calls(gpu).items():
            if answer is not None:
                calls.setdefault(function, {})[str(index)] = answer
        ecc = _uncorrected_volatile(gpu)
        if ecc is not None:
            # nvmlDeviceGetTotalEccErrors(handle, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)
            calls.setdefault("nvmlDeviceGetTotalEccErrors", {})[f"{index}/1/0"] = ecc
    return {"format": "preflight-nvml/1", "calls": calls}


def write_root(dump: bytes, root: Path) -> Path:
    """Write the node root for ``dump`` under ``root``; returns the recording's path."""
    recording = root / ".preflight" / "nvml.json"
    recording.parent.mkdir(parents=True, exist_ok=True)
    recording.write_text(json.dumps(convert(dump), indent=1, sort_keys=True) + "\n")
    return recording


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    print(write_root(Path(argv[1]).read_bytes(), Path(argv[2])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
