"""Static analysis of log signatures (the regular expressions in the catalogue).

Two properties keep ``preflight explain`` fast and safe on untrusted logs:

* every signature has **required literals**: a set of plain strings, one of which must occur in
  any line the pattern matches. The scanner looks for those literals with fast substring search
  and runs the regular expression only on lines that contain one, so a million lines of INFO
  noise cost a few substring scans instead of a million regex calls per pattern;
* no signature can backtrack catastrophically: nested unbounded repeats (``(a+)+``) are
  rejected, and at most two unbounded "anything" repeats may appear, on lines whose length
  the scanner bounds.
"""

from __future__ import annotations

import importlib
import re
from typing import Any


def _load_parser() -> Any:
    """The regex parser: ``re._parser`` from Python 3.11, the (since deprecated) ``sre_parse``
    module before that."""
    try:
        return importlib.import_module("re._parser")
    except ImportError:  # pragma: no cover - Python 3.10
        return importlib.import_module("sre_parse")


sre_parse = _load_parser()

ROLES = ("cause", "symptom", "context")
MIN_LITERAL = 4
MAX_WILDCARDS = 2

_OP = sre_parse  # opcode names live on the parser module in both versions
_UNBOUNDED = sre_parse.MAXREPEAT


def required_literals(pattern: str) -> tuple[str, ...]:
    """Strings of which at least one occurs in every match of ``pattern``; the longest choice.

    Empty when no such set with every member at least ``MIN_LITERAL`` long can be derived."""
    return analyse(pattern)[0]


def analyse(pattern: str) -> tuple[tuple[str, ...], int]:
    """``(required_literals(pattern), specificity(pattern))`` from one parse: building the
    matcher needs both for every signature, and parsing is most of what that costs."""
    parsed = sre_parse.parse(pattern)
    items = list(parsed)
    best = None if parsed.state.flags & re.IGNORECASE else _best_requirement(items)
    return (tuple(sorted(best)) if best else ()), _specificity(items)


def _best_requirement(items: list[tuple[Any, Any]]) -> frozenset[str] | None:
    """The required-literal set of a sequence whose shortest member is longest."""
    candidates: list[frozenset[str]] = []
    run: list[str] = []

    def close_run() -> None:
        if run:
            candidates.append(frozenset(["".join(run)]))
            run.clear()

    for op, value in items:
        if op is _OP.LITERAL:
            run.append(chr(value))
            continue
        close_run()
        if op is _OP.SUBPATTERN:
            inner = _best_requirement(list(value[-1]))
            if inner:
                candidates.append(inner)
        elif op is _OP.BRANCH:
            branches = [_best_requirement(list(branch)) for branch in value[1]]
            if all(branches):
                candidates.append(frozenset().union(*branches))  # type: ignore[arg-type]
        elif op in (_OP.MAX_REPEAT, _OP.MIN_REPEAT) and value[0] >= 1:
            inner = _best_requirement(list(value[2]))
            if inner:
                candidates.append(inner)
    close_run()
    usable = [c for c in candidates if min(len(s) for s in c) >= MIN_LITERAL]
    if not usable:
        return None
    return max(usable, key=lambda c: (min(len(s) for s in c), -len(c)))


def safety_problems(pattern: str) -> list[str]:
    """Why ``pattern`` could take super-linear time on a hostile line; empty when it cannot."""
    problems: list[str] = []
    wildcards = 0

    def walk(items: list[tuple[Any, Any]], inside_unbounded: bool) -> None:
        nonlocal wildcards
        for op, value in items:
            if op in (_OP.MAX_REPEAT, _OP.MIN_REPEAT, getattr(_OP, "POSSESSIVE_REPEAT", None)):
                low, high, body = value
                unbounded = high is _UNBOUNDED or high == _UNBOUNDED
                body_items = list(body)
                if unbounded and inside_unbounded:
                    problems.append("nested unbounded repeat (can backtrack exponentially)")
                if unbounded and _is_broad(body_items):
                    wildcards += 1
                walk(body_items, inside_unbounded or (unbounded and high != 1))
            elif op is _OP.SUBPATTERN:
                walk(list(value[-1]), inside_unbounded)
            elif op is _OP.BRANCH:
                for branch in value[1]:
                    walk(list(branch), inside_unbounded)
            elif op in (_OP.ASSERT, _OP.ASSERT_NOT):
                walk(list(value[1]), inside_unbounded)
            elif op is _OP.GROUPREF:
                problems.append("backreferences are not allowed")

    walk(list(sre_parse.parse(pattern)), False)
    if wildcards > MAX_WILDCARDS:
        problems.append(f"{wildcards} unbounded wildcard repeats (at most {MAX_WILDCARDS}; use a bounded .{{0,200}})")
    return problems


def _is_broad(items: list[tuple[Any, Any]]) -> bool:
    """A repeat body that matches almost any character: ``.``, ``[^x]``, ``\\S`` and the like."""
    if len(items) != 1:
        return False
    op, value = items[0]
    if op is _OP.ANY:
        return True
    if op is _OP.IN:
        return any(kind is _OP.NEGATE for kind, _ in value) or any(
            kind is _OP.CATEGORY and value_ in (_OP.CATEGORY_NOT_SPACE, _OP.CATEGORY_NOT_DIGIT, _OP.CATEGORY_NOT_WORD)
            for kind, value_ in value
        )
    return False


def specificity(pattern: str) -> int:
    """How much a match of ``pattern`` pins down: the characters every match must contain.

    Literal characters count one each and digits two, because a number in a message (``vendor
    err 129``, ``status=12``, ``GID index 3``, a ``fe80:`` prefix) is what separates one cause
    from another that prints the same words. An alternation counts its poorest branch, an
    optional part nothing. Ranking uses it so that, on one line, the signature that says the
    most beats the one that says the least."""
    return _specificity(list(sre_parse.parse(pattern)))


def _specificity(items: list[tuple[Any, Any]]) -> int:
    total = 0
    for op, value in items:
        if op is _OP.LITERAL:
            total += 2 if chr(value).isdigit() else 1
        elif op is _OP.SUBPATTERN:
            total += _specificity(list(value[-1]))
        elif op is _OP.BRANCH:
            total += min(_specificity(list(branch)) for branch in value[1])
        elif op in (_OP.MAX_REPEAT, _OP.MIN_REPEAT, getattr(_OP, "POSSESSIVE_REPEAT", None)) and value[0] >= 1:
            total += min(value[0], 4) * _specificity(list(value[2]))
    return total
