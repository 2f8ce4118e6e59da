"""``preflight probes list``: the probes, what they read and the facts they give checks."""

from __future__ import annotations

import json
from typing import Any

from preflight.cli.spec import Command, Option, Values, error

GROUP_HELP = "The probes that gather a node's facts."


def probe_rows(profile: str | None = None) -> list[dict[str, Any]]:
    """One row per probe of the built-in registry (and installed plugins): its name, module,
    sources, the probes it needs, the profiles that gather it, the checks that read it, and the
    fields of its facts."""
    from preflight.discovery import build_registry
    from preflight.facts import fact_fields

    registry = build_registry(profile=profile)
    readers: dict[str, list[str]] = {}
    for ref_id, check in sorted(registry.checks.items()):
        for name in check.probes:
            readers.setdefault(name, []).append(ref_id)
    rows = []
    for name, spec in sorted(registry.probes.items()):
        rows.append({
            "name": name,
            "module": spec.origin,
            "sources": list(spec.sources),
            "needs": list(spec.needs),
            "gathered_in": list(spec.gather_in),
            "checks": readers.get(name, []),
            "facts": fact_fields(spec.func),
        })
    return rows


def run_list(values: Values) -> int:
    from preflight.registry import RegistrationError

    if values["output_format"] not in ("table", "json"):
        return error("--format must be table or json")
    try:
        rows = probe_rows()
    except RegistrationError as problem:
        return error(str(problem))
    if values["output_format"] == "json":
        print(json.dumps(rows, indent=2))
        return 0
    from preflight.reporters.table import fit_table

    table = [
        [row["name"], ", ".join(row["sources"] + row["needs"]), ", ".join(row["checks"]) or "-", row["facts"]["type"] + ": " + ", ".join(row["facts"]["fields"])]
        for row in rows
    ]
    print(fit_table(table, ["Probe", "Reads", "Checks", "Facts"], wrap={1: 1, 2: 1, 3: 3}))
    return 0


COMMANDS = (
    Command(
        ("probes", "list"),
        "List the probes: the sources and probes each reads, the checks that use its facts, and the facts' fields.",
        run_list,
        options=(Option("--format", "output_format", "table or json.", default="table"),),
    ),
)
