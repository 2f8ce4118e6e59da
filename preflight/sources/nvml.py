"""NVML answers, live through pynvml (package ``nvidia-ml-py``) or replayed from a recording.

The boundary is one call: ``call("nvmlDeviceGetName", index, *args)``. Live, it runs the pynvml
function of that name on the device handle for ``index`` (or without a handle when ``index`` is
None), followed by ``args`` - integers such as a link number or an NVML enum value, or
:class:`Gpu` for a second device's handle (``nvmlDeviceGetP2PStatus(h0, h1, caps)``) - and returns
plain Python values (bytes become str, ctypes structs become dicts). Replayed, it looks up the same
key in ``<root>/.preflight/nvml.json``; with extra arguments the per-device key is the index and
the arguments joined by ``/`` (``"0/3"`` is link 3 of GPU 0, ``"0/gpu1/0"`` a P2P query from GPU 0
to GPU 1 for capability 0):

.. code-block:: json

    {"format": "preflight-nvml/1",
     "init": {"error": "NVML_ERROR_DRIVER_NOT_LOADED"},          # optional: nvmlInit failed
     "calls": {
        "nvmlSystemGetDriverVersion": {"result": "550.54.15"},
        "nvmlDeviceGetCount": {"result": 8},
        "nvmlDeviceGetName": {"0": {"result": "NVIDIA H100 80GB HBM3"},
                              "1": {"error": "NVML_ERROR_GPU_IS_LOST"},
                              "2": {"hang": true}},
        "nvmlDeviceGetNvLinkState": {"0/0": {"result": 1}, "0/1": {"result": 0}}}}

``error`` names an ``NVML_ERROR_*`` constant; ``hang`` blocks forever, as a wedged driver does
(the engine's deadline must cope). A call that was never recorded raises ``NVML_NOT_RECORDED``.
pynvml is imported only when the live source is first used: it costs ~20 ms and dlopens
``libnvidia-ml.so.1``.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol, Union

from msgspec import Struct

from preflight.sources.fs import load_recording

#: Codes meaning "the recording cannot say" (never what a driver answers): checks make them
#: ``unknown``, where a real NVML error may mean "no GPU here".
UNANSWERED = frozenset({"NVML_NOT_RECORDED", "NVML_REPLAY_UNREADABLE"})


class NvmlError(Exception):
    """An NVML call failed; ``code`` is the ``NVML_ERROR_*`` name (or ``NVML_NOT_RECORDED``)."""

    def __init__(self, code: str, detail: str = "") -> None:
        super().__init__(f"{code}{': ' + detail if detail else ''}")
        self.code = code


class Gpu(Struct, frozen=True):
    """An extra argument meaning "the handle of GPU ``index``" (for calls relating two GPUs)."""

    index: int

    def __str__(self) -> str:
        return f"gpu{self.index}"


Argument = Union[int, Gpu]


class Nvml(Protocol):
    """What probes may ask of NVML."""

    def call(self, function: str, index: int | None = None, *args: Argument) -> Any:
        """Run ``function`` (for device ``index``, with ``args``) and return a plain Python value."""
        ...


def replay_key(index: int, args: tuple[Argument, ...]) -> str:
    """The per-device key of a recorded answer: ``"3"``, or ``"3/1"`` with arguments."""
    return "/".join([str(index), *(str(argument) for argument in args)])


def plain(value: Any) -> Any:
    """ctypes results as JSON-friendly values: bytes -> str, structs -> dicts, arrays -> lists."""
    import ctypes

    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, ctypes.Structure):
        fields = {}
        for name, *_ in value._fields_:
            if name in _BINARY_FIELDS:
                # ctypes hands a char array back as bytes cut at the first NUL, which would turn a
                # UUID with a zero byte into a shorter one (or into nothing): take the raw bytes.
                field = getattr(type(value), name)
                fields[name] = list(ctypes.string_at(ctypes.addressof(value) + field.offset, field.size))
            else:
                fields[name] = plain(getattr(value, name))
        return fields
    if isinstance(value, ctypes.Array):
        return [plain(item) for item in value]
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if type(value).__name__ == "nvmlFriendlyObject":
        # pynvml's list-returning wrappers (nvmlDeviceGetComputeRunningProcesses) copy each struct
        # into a plain object whose attributes are the struct's fields.
        return {name: plain(field) for name, field in vars(value).items()}
    return value


class LiveNvml:
    """pynvml against the real driver. Initialised once, lazily, from any probe thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._module: Any = None
        self._init_error: NvmlError | None = None

    def _pynvml(self) -> Any:
        with self._lock:
            if self._module is None and self._init_error is None:
                try:
                    import pynvml
                except ImportError as error:
                    self._init_error = NvmlError("NVML_ERROR_LIBRARY_NOT_FOUND", f"pynvml: {error}")
                else:
                    try:
                        pynvml.nvmlInit()
                        self._module = pynvml
                    except pynvml.NVMLError as error:
                        self._init_error = NvmlError(_error_name(pynvml, error), str(error))
                    except OSError as error:
                        self._init_error = NvmlError("NVML_ERROR_LIBRARY_NOT_FOUND", str(error))
            if self._init_error is not None:
                raise self._init_error
            return self._module

    def call(self, function: str, index: int | None = None, *args: Argument) -> Any:
        pynvml = self._pynvml()
        target = getattr(pynvml, function, None)
        if target is None or not function.startswith("nvml"):
            raise NvmlError("NVML_ERROR_FUNCTION_NOT_FOUND", function)
        try:
            if index is None:
                return plain(target())
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            extra = [
                pynvml.nvmlDeviceGetHandleByIndex(argument.index) if isinstance(argument, Gpu) else argument
                for argument in args
            ]
            out_struct = _OUT_STRUCTS.get(function)
            if out_struct is not None:  # the caller allocates the result, as in the C API
                result = getattr(pynvml, out_struct)()
                target(handle, *extra, result)
                return plain(result)
            return plain(target(handle, *extra))
        except pynvml.NVMLError as error:
            raise NvmlError(_error_name(pynvml, error), str(error)) from None


# char-array struct fields that hold bytes, not text (nvmlGpuFabricInfo_t.clusterUuid); the replay
# format lists their byte values.
_BINARY_FIELDS = frozenset({"clusterUuid"})

# Functions whose pynvml wrapper fills a struct passed in by the caller instead of returning one.
_OUT_STRUCTS = {"nvmlDeviceGetGpuFabricInfo": "c_nvmlGpuFabricInfo_t"}


def _error_name(pynvml: Any, error: Any) -> str:
    code = getattr(error, "value", None)
    for name in dir(pynvml):
        if name.startswith("NVML_ERROR_") and getattr(pynvml, name) == code:
            return name
    return "NVML_ERROR_UNKNOWN"


#: More GPUs than any node holds (an HGX or NVL board has 8, the largest PCIe chassis 20 or so):
#: a recording claiming more is refused, since probes ask NVML per device and per pair.
MAX_REPLAYED_DEVICES = 256


class ReplayNvml:
    """Answers from a recorded ``nvml.json`` (format in the module docstring)."""

    def __init__(self, document: dict[str, Any], origin: str = "nvml.json") -> None:
        self._origin = origin
        calls = document.get("calls", {}) if isinstance(document, dict) else {}
        self._calls: dict[str, Any] = calls if isinstance(calls, dict) else {}
        init = document.get("init") if isinstance(document, dict) else None
        self._init_answer = init if isinstance(init, dict) else None

    @classmethod
    def from_file(cls, path: str) -> ReplayNvml:
        try:
            document = load_recording(path)
        except ValueError as error:
            return cls({"init": {"error": "NVML_REPLAY_UNREADABLE", "detail": str(error)}})
        if not isinstance(document, dict) or not isinstance(document.get("calls", {}), dict):
            return cls({"init": {"error": "NVML_REPLAY_UNREADABLE", "detail": f"{path}: not an object with a 'calls' object"}})
        return cls(document, origin=path)

    def call(self, function: str, index: int | None = None, *args: Argument) -> Any:
        if self._init_answer is not None:
            _answer(self._init_answer, "nvmlInit")
        entry = self._calls.get(function)
        if entry is not None and index is not None:
            entry = entry.get(replay_key(index, args)) if isinstance(entry, dict) else None
        if not isinstance(entry, dict):
            where = function if index is None else f"{function}[{replay_key(index, args)}]"
            raise NvmlError("NVML_NOT_RECORDED", f"{where} is not in {self._origin}")
        answer = _answer(entry, function)
        if function == "nvmlDeviceGetCount" and isinstance(answer, int) and answer > MAX_REPLAYED_DEVICES:
            # Probes ask per device and per pair of devices: a recording must not choose that work.
            raise NvmlError("NVML_REPLAY_UNREADABLE", f"{self._origin}: {answer} devices, more than any node has (at most {MAX_REPLAYED_DEVICES} are replayed)")
        return answer


def _answer(entry: dict[str, Any], function: str) -> Any:
    if entry.get("hang"):
        threading.Event().wait()  # as a wedged driver does: forever
    if "error" in entry:
        raise NvmlError(str(entry["error"]), str(entry.get("detail", function)))
    return entry.get("result")


class NoNvml:
    """Used for a recorded root without an NVML recording: every call says so."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def call(self, function: str, index: int | None = None, *args: Argument) -> Any:
        raise NvmlError("NVML_NOT_RECORDED", self.reason)
