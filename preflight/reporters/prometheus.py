"""Prometheus text exposition for node_exporter's textfile collector.

One gauge series per (reference, status) with value 1 for the reference's status and 0 for the
others, so alerts can use ``preflight_reference_status{status="present"} == 1``; per-probe
duration and success gauges; run duration and completion time (node_exporter conventions:
``_seconds`` units, a ``_timestamp_seconds`` gauge for the last run).
"""

from __future__ import annotations

from preflight.engine import Report
from preflight.model import Status

# When a reference has several subjects the worst status stands for it.
_STATUS_ORDER = (Status.PRESENT, Status.UNKNOWN, Status.ABSENT, Status.NOT_APPLICABLE)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(report: Report, show_all: bool) -> str:
    by_reference: dict[str, tuple[str, str, set[Status]]] = {}
    for finding in report.findings:
        entry = by_reference.setdefault(finding.reference_id, (finding.symbol, finding.severity.value, set()))
        entry[2].add(finding.status)
    lines = [
        "# HELP preflight_reference_status 1 for the status a catalogued reference has on this node.",
        "# TYPE preflight_reference_status gauge",
    ]
    for ref_id in sorted(by_reference):
        symbol, severity, statuses = by_reference[ref_id]
        worst = next(status for status in _STATUS_ORDER if status in statuses)
        for status in _STATUS_ORDER:
            labels = f'id="{ref_id}",symbol="{_label(symbol)}",severity="{severity}",status="{status.value}"'
            lines.append(f"preflight_reference_status{{{labels}}} {1 if status is worst else 0}")
    lines += [
        "# HELP preflight_probe_duration_seconds Time one probe took.",
        "# TYPE preflight_probe_duration_seconds gauge",
    ]
    for probe in report.probes:
        lines.append(f'preflight_probe_duration_seconds{{probe="{probe.name}"}} {probe.duration_s:.6f}')
    lines += [
        "# HELP preflight_probe_success 1 when the probe finished without error or timeout.",
        "# TYPE preflight_probe_success gauge",
    ]
    for probe in report.probes:
        lines.append(f'preflight_probe_success{{probe="{probe.name}"}} {1 if probe.status == "ok" else 0}')
    lines += [
        "# HELP preflight_run_duration_seconds Wall time of the whole run.",
        "# TYPE preflight_run_duration_seconds gauge",
        f'preflight_run_duration_seconds{{profile="{report.profile}"}} {report.duration_s:.6f}',
        "# HELP preflight_last_run_timestamp_seconds When the run started (Unix time).",
        "# TYPE preflight_last_run_timestamp_seconds gauge",
        f"preflight_last_run_timestamp_seconds {report.started_at:.3f}",
    ]
    return "\n".join(lines) + "\n"
