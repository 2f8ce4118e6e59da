"""Render a :class:`~preflight.engine.Report` for people and machines.

Each reporter module exposes ``render(report, show_all) -> str`` and is imported only when its
format is asked for (tabulate alone costs ~50 ms to import).
"""

from __future__ import annotations

import importlib

from preflight.engine import Report

FORMATS = {"table": "table", "json": "json_report", "prometheus": "prometheus", "junit": "junit"}


def render(report: Report, output_format: str, show_all: bool = False) -> str:
    module = importlib.import_module(f"preflight.reporters.{FORMATS[output_format]}")
    text: str = module.render(report, show_all)
    return text
