"""How well ``explain`` names the cause of real failure logs (tests/data/real-logs).

Prints the figures of both parts, and per-log results of the development part only: signatures
are written while looking at those, never at the held-back test part. The held-back part is also
shown without the threads the catalogue cites (a reference's sources, claims or coverage notes):
a reference written with a thread in view may fit that thread's log better than a stranger's.
Both parts are also shown split by whether the search store kept the post whole: a log it cut
short often stops before the lines that name the cause.

    .venv/bin/python bench/explain_accuracy.py [--misses] [--batches zu,zv]

``--batches`` keeps only the logs of those batches (the id's first word): run it on a new gathering
before writing anything for it, and the figures are how ``explain`` does on logs it has never seen.
Its development logs are listed one by one; its held-back logs only counted. Each listed log shows
its first four candidates as ID/tier: c cause, x context, s symptom.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

# The checkout's preflight and catalogue, as the tests use them, not an installed copy that an
# edit has not reached yet.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from real_logs import OUTSIDE, THREAD_URL, Outcome, corpus, evaluate, figures  # noqa: E402

from preflight.explain import load_catalogue  # noqa: E402


#: candidate tiers as the miss lists print them (cause and context both start with "c")
TIER_MARK = {"cause": "c", "context": "x", "symptom": "s"}
REFERENCES = Path(__file__).resolve().parent.parent / "references"


def cited_threads() -> set[str]:
    """Every GitHub thread a reference, claim file or coverage table names."""
    return {url for path in REFERENCES.rglob("*.toml") for url in THREAD_URL.findall(path.read_text(encoding="utf-8"))}


def batches_asked() -> set[str] | None:
    """The batches after ``--batches`` (comma-separated), or None for the whole corpus."""
    if "--batches" not in sys.argv:
        return None
    index = sys.argv.index("--batches") + 1
    if index >= len(sys.argv) or sys.argv[index].startswith("-"):
        sys.exit("--batches needs the batch names, comma-separated (e.g. --batches zu,zv)")
    return set(sys.argv[index].split(","))


def kinds_of_miss(outcomes: list[Outcome]) -> str:
    """How the catalogued-cause logs not ranked first were answered: counts only, so the held-back
    part can be shown without reading its logs."""
    kinds: Counter[str] = Counter()
    for outcome in outcomes:
        if outcome.log.reference == OUTSIDE or outcome.top1:
            continue
        if not outcome.ranking:
            kinds[f"no candidate ({outcome.status})"] += 1
        elif outcome.top3:
            kinds["right cause second or third"] += 1
        elif all(tier == "symptom" for tier in outcome.tiers):
            kinds["symptoms only"] += 1
        else:
            kinds["another cause or context first"] += 1
    return ", ".join(f"{count} {kind}" for kind, count in kinds.most_common()) or "none"


def main() -> int:
    catalogue = load_catalogue()
    batches = batches_asked()
    show_misses = "--misses" in sys.argv
    for split in ("dev", "test"):
        logs = [log for log in corpus(split) if batches is None or log.id.split("-", 1)[0] in batches]
        outcomes = evaluate(logs, catalogue)
        print(f"== {split} ({len(outcomes)} logs)")
        for line in figures(outcomes).lines():
            print("  " + line)
        print("  misses: " + kinds_of_miss(outcomes))
        if split == "test":
            cited = cited_threads()
            uncited = [outcome for outcome in outcomes if outcome.log.thread not in cited]
            print(f"== test, threads the catalogue does not cite ({len(uncited)} logs)")
            for line in figures(uncited).lines():
                print("  " + line)
        for truncated in (False, True):
            part = [outcome for outcome in outcomes if outcome.log.truncated == truncated]
            kept = "cut short by the source store" if truncated else "kept whole"
            found = figures(part)
            print(f"== {split}, logs {kept} ({len(part)}): top-1 {found.top1:.1%}, top-3 {found.top3:.1%}, no candidate {found.no_candidate:.1%}")
        if split == "dev" and (show_misses or batches is not None):
            for outcome in outcomes:
                log = outcome.log
                wrong = (not outcome.top1) if log.reference != OUTSIDE else outcome.catalogued_cause
                shown = ", ".join(f"{r}/{TIER_MARK[t]}" for r, t in zip(outcome.ranking[:4], outcome.tiers)) or outcome.status
                if wrong or outcome.silent:
                    print(f"  MISS {log.id} [{log.reference}] -> {shown}")
                elif batches is not None:
                    print(f"  OK   {log.id} [{log.reference}] -> {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
