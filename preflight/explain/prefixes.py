"""Who wrote a log line, and when: peel the prefixes that launchers and log shippers stack in
front of a message.

A line of a failed multi-node run rarely starts with the message. Typical stacks are::

    2026-03-14T09:21:33.123456789Z [pod/trainer-3/pytorch] [rank3]:[E314 09:21:33.123 ...] msg
    [1,3]<stderr>:gpu-node-07:20871:21002 [3] NCCL WARN msg
    gpu-node-07: Mar 14 09:21:33 gpu-node-07 kernel: [ 1234.567890] mlx5_core 0000:1a:00.0: msg

Signatures never anchor on a prefix, so matching works without this module; it exists to tell
which host or rank failed first, which is what a cascade analysis needs. The parser peels
known forms one at a time from the left and stops at the first thing it does not recognise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone
from preflight.units import is_number

# ESC-based sequences, and the "[0m"/"[31;1m" remnants left when a shipper drops the ESC byte.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\[[0-9][0-9;]{0,7}m")

_ISO = re.compile(
    r"\[?(?P<iso>\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d)(?P<frac>[.,]\d{1,9})?(?P<tz>Z|[+-]\d\d:?\d\d)?"
    # SGLang puts its parallel ranks inside the bracket: "[2025-05-19 06:08:25 TP3 EP3] "
    r"(?P<parallel>(?: (?:TP|DP|PP|EP|CP)\d{1,5}){1,4})?\]?[ \t]*"
)
_SYSLOG = re.compile(r"(?P<mon>[A-Z][a-z]{2}) +(?P<day>\d{1,2}) (?P<hms>\d\d:\d\d:\d\d)(?:\.\d+)? (?P<host>[\w.-]+) [\w./-]+(?:\[\d+\])?: ")
# "[ 1234.567890] " is dmesg's seconds since boot; "[1773480093.123456] " (UCX) is epoch time.
_DMESG = re.compile(r"\[ *(?P<uptime>\d+\.\d+)\] ")
_UCX = re.compile(r"\[(?P<host>[\w.-]+):(?P<pid>\d+):\d+\] +(?:[\w.]+:\d+ +)?(?:UCX +[A-Z]+ +)?")
# c10/glog: "[E0314 09:21:33.123456789 ProcessGroupNCCL.cpp:616] " or, before 2.3, "[E ProcessGroupNCCL.cpp:475] "
_GLOG = re.compile(r"\[?[IWEF](?:(?P<md>\d{4}) (?P<hms>\d\d:\d\d:\d\d)(?:\.\d+)?(?: +\d+)? | )[\w.]+:\d+\] ")
_RANK = re.compile(r"\[(?:rank|default|Rank )(?P<rank>\d+)\]:? ?")
_MPI = re.compile(r"\[\d+,(?P<rank>\d+)\]<(?:stdout|stderr)>: ?")
_RAY = re.compile(r"\((?:[\w.]+ )?pid=(?P<pid>\d+)(?:, ip=(?P<ip>[\d.:a-f]+))?\) ")
_POD = re.compile(r"\[pod/(?P<pod>[\w.-]+)/[\w.-]+\] ")
_SRUN = re.compile(r" *(?P<rank>\d{1,6}): ")
_LEVEL = re.compile(r"(?:\[?(?:INFO|WARNING|WARN|ERROR|CRITICAL|DEBUG)\]?[: ] ?|[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ )")
_PYLOG_SOURCE = re.compile(r"\[[\w./-]+\.py:\d+(?::\w+)?\] ")
# A launcher's "[1763] " process-id prefix (DeepSpeed, some MPI wrappers); dmesg's has a dot.
_PID = re.compile(r"\[(?P<pid>\d{1,7})\] ")
# A tqdm bar a rank drew on the same line before its error: "Loading:  45%|####5  | 9/20 [00:01<00:02, 6.1it/s]"
_PROGRESS = re.compile(r"[^|\n]{0,80}?\d{1,3}%\|[^|]{0,200}\| *[\d.]+[kMG]?/[\d.?]+[kMG]? ?(?:\[[^\]]{0,120}\])?")
# NCCL's header; WARN lines of many releases put the source "file.cc:line " before "NCCL".
_NCCL = re.compile(r"(?P<host>[\w.-]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>-?\d*)\] (?:[\w./-]{1,80}:\d+ )?NCCL (?P<level>[A-Z]+) ")
_HOST = re.compile(r"(?P<host>[a-zA-Z][\w-]*(?:\.[\w-]+)*|\d{1,3}(?:\.\d{1,3}){3}): ")
_CLOUDWATCH = re.compile(r"[^\t]{1,200}\t")
_MONTHS = {m: i for i, m in enumerate("Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split(), 1)}
_MAX_PEELS = 12


@dataclass
class LineMeta:
    """What the prefixes say about a line; None where they do not say."""

    time: float | None = None  # seconds since the epoch, comparable across hosts
    time_text: str | None = None
    host: str | None = None
    rank: int | None = None
    pid: int | None = None
    nccl_level: str | None = None
    parallel: str | None = None  # SGLang's "TP3 EP3": the parallel ranks of the process


    @property
    def actor(self) -> str | None:
        """The best name for the process that wrote the line."""
        if self.rank is not None:
            return f"rank {self.rank}"  # ranks are unique in a job; hosts and pids repeat them
        if self.host and self.pid is not None:
            return f"{self.host} pid {self.pid}"
        if self.parallel:
            return self.parallel
        return self.host or (f"pid {self.pid}" if self.pid is not None else None)


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text) if ("\x1b" in text or "[" in text) else text


def parse_line(text: str, year: int) -> tuple[LineMeta, str]:
    """``(meta, message)`` for one line (already without its newline and colour codes)."""
    meta = LineMeta()
    rest = text
    for _ in range(_MAX_PEELS):
        peeled = _peel_one(rest, meta, year)
        if peeled is None:
            break
        rest = peeled
    _rank_from_message(rest, meta)
    return meta, rest


def _peel_one(rest: str, meta: LineMeta, year: int) -> str | None:
    """Remove one recognised prefix from ``rest`` and record what it says; None if none fits."""
    if not rest:
        return None
    first = rest[0]
    if is_number(first):
        match = _ISO.match(rest)
        if match:
            _set_time(meta, _iso_epoch(match), _iso_text(match))
            return rest[match.end() :]
        match = _SRUN.match(rest)
        if match and meta.rank is None:
            meta.rank = int(match.group("rank"))
            return rest[match.end() :]
    if "%|" in rest[:120]:
        match = _PROGRESS.match(rest)
        if match and match.end() > 0:
            return rest[match.end() :]
    if first == "[":
        for pattern in (_ISO, _RANK, _MPI, _POD, _DMESG, _UCX, _GLOG, _PYLOG_SOURCE, _PID):
            match = pattern.match(rest)
            if match:
                _record(pattern, match, meta, year)
                return rest[match.end() :]
    if first == "(":
        match = _RAY.match(rest)
        if match:
            meta.pid = int(match.group("pid"))
            meta.host = meta.host or match.group("ip")
            return rest[match.end() :]
    if first == " ":
        stripped = rest.lstrip(" ")
        return stripped if stripped != rest else None
    for pattern in (_SYSLOG, _GLOG, _NCCL, _LEVEL):
        match = pattern.match(rest)
        if match:
            _record(pattern, match, meta, year)
            return rest[match.end() :]
    match = _HOST.match(rest)
    if match and not _looks_like_message(match.group("host")):
        meta.host = meta.host or match.group("host")
        return rest[match.end() :]
    if "\t" in rest[:200]:
        match = _CLOUDWATCH.match(rest)
        if match:
            return rest[match.end() :]
    return None


def _record(pattern: re.Pattern[str], match: re.Match[str], meta: LineMeta, year: int) -> None:
    if pattern is _ISO:
        _set_time(meta, _iso_epoch(match), _iso_text(match))
        if match.group("parallel") and meta.rank is None:
            meta.parallel = match.group("parallel").strip()
    elif pattern is _PID:
        meta.pid = int(match.group("pid"))
    elif pattern in (_RANK, _MPI):
        meta.rank = int(match.group("rank"))
    elif pattern is _DMESG:
        seconds = float(match.group("uptime"))
        if seconds > 1e9:  # an epoch timestamp, not an uptime
            _set_time(meta, seconds, datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"))
    elif pattern is _UCX:
        meta.host, meta.pid = match.group("host"), int(match.group("pid"))
    elif pattern is _POD:
        meta.host = meta.host or match.group("pod")
    elif pattern is _SYSLOG:
        meta.host = match.group("host")
        month = _MONTHS.get(match.group("mon"), 1)
        hms = match.group("hms")
        _set_time(meta, _epoch(year, month, int(match.group("day")), hms), f"{match.group('mon')} {match.group('day')} {hms}")
    elif pattern is _GLOG and match.group("md"):
        md, hms = match.group("md"), match.group("hms")
        _set_time(meta, _epoch(year, int(md[:2]), int(md[2:]), hms), f"{md[:2]}-{md[2:]} {hms}")
    elif pattern is _NCCL:
        meta.host = match.group("host")
        meta.pid = int(match.group("pid"))
        meta.nccl_level = match.group("level")


def _set_time(meta: LineMeta, epoch: float | None, text: str) -> None:
    # The outermost timestamp (added last, by the shipper) comes first; keep the innermost one,
    # which the process itself wrote and which is comparable across that process's lines.
    if epoch is not None:
        meta.time, meta.time_text = epoch, text


def _iso_text(match: re.Match[str]) -> str:
    return match.group("iso") + (match.group("frac") or "") + (match.group("tz") or "")


def _iso_epoch(match: re.Match[str]) -> float | None:
    try:
        moment = datetime.fromisoformat(match.group("iso").replace(" ", "T"))
    except ValueError:
        return None
    tz = match.group("tz")
    if tz and tz != "Z":
        sign = 1 if tz[0] == "+" else -1
        digits = tz[1:].replace(":", "")
        offset = sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    else:
        offset = 0
    fraction = float("0" + match.group("frac").replace(",", ".")) if match.group("frac") else 0.0
    return moment.replace(tzinfo=timezone.utc).timestamp() - offset + fraction


def _epoch(year: int, month: int, day: int, hms: str) -> float | None:
    try:
        hour, minute, second = (int(part) for part in hms.split(":"))
        return datetime(year, month, day, hour, minute, second, tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None


_MESSAGE_WORDS = frozenset(
    "Traceback RuntimeError Error Warning WARNING ERROR INFO Exception torch NCCL socket ValueError".split()
)


def _looks_like_message(word: str) -> bool:
    """``RuntimeError: ...`` is a message, ``gpu-node-07: ...`` is a pdsh host prefix."""
    return word in _MESSAGE_WORDS or word.endswith(("Error", "Exception", "Warning")) or word.startswith("torch.")


_RANK_IN_MESSAGE = re.compile(r"\[(?:Rank|PG \d+ Rank) (?P<rank>\d+)\]|\brank[ =:](?P<rank2>\d+)\b")


def _rank_from_message(message: str, meta: LineMeta) -> None:
    if meta.rank is not None or "ank" not in message:
        return
    match = _RANK_IN_MESSAGE.search(message[:400])
    if match:
        meta.rank = int(match.group("rank") or match.group("rank2"))
