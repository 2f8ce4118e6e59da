"""Exit codes of ``preflight node`` (documented in docs/operators/node.md).

* 0: nothing present at warning or above (info findings and unknowns allowed);
* 1: the worst present finding is a warning;
* 2: an error or critical finding is present;
* 3: no verdict: bad arguments, a missing or unreadable root, a broken config or plugin, or
  (``preflight node``) every check unknown.

Unknown findings do not change the code unless the site's ``[policy] unknown`` says so: a bug
or a hung driver in the checker must not drain a fleet by default.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from preflight.model import Finding, Severity, Status


class ExitCode(enum.IntEnum):
    OK = 0
    WARNING = 1
    ERROR = 2
    NO_VERDICT = 3


def exit_code(findings: Iterable[Finding], unknown_policy: str = "ignore") -> ExitCode:
    worst = ExitCode.OK
    for finding in findings:
        if finding.status is Status.PRESENT:
            if finding.severity in (Severity.CRITICAL, Severity.ERROR):
                return ExitCode.ERROR
            if finding.severity is Severity.WARNING:
                worst = ExitCode.WARNING
        elif finding.status is Status.UNKNOWN and unknown_policy != "ignore":
            if unknown_policy == "error":
                return ExitCode.ERROR
            worst = ExitCode.WARNING
    return worst
