"""JSON report, schema ``preflight-report/1`` (``preflight/schemas/report-v1.schema.json``).

Every finding is included, whatever ``--show-all`` says: machines filter for themselves.
"""

from __future__ import annotations

import json

from preflight.engine import Report


def render(report: Report, show_all: bool) -> str:
    return json.dumps(report.to_json(), indent=2, sort_keys=False) + "\n"
