"""``preflight explain`` judged on real failure logs from public issue threads.

The corpus (tests/data/real-logs, see its README) is split once, by thread, into a development
part, which signatures are written against, and a held-back test part, which only this test
reads. The floors below are the figures reached on the held-back part when they were last
raised; CI fails if a change makes explain worse on logs nobody tuned it for.
"""

from __future__ import annotations

import collections
import re
import tomllib

import pytest
from conftest import load_script
from real_logs import CORPUS, OUTSIDE, THREAD_URL, corpus, evaluate, figures

from preflight.catalogue import load_all
from preflight.explain import explain, load_catalogue

# Held-back figures (tests/data/real-logs, test part), measured when last raised; see
# bench/explain_accuracy.py for all figures. Floors, not goals: the goals are top-1 85 %,
# top-3 95 %, no candidate 0 %, out-of-catalogue logs given a cause <= 20 %.
TOP1_FLOOR = 0.507
TOP3_FLOOR = 0.547
NO_CANDIDATE_CEILING = 0.286
OUTSIDE_CAUSE_CEILING = 0.20
SILENT_CEILING = 23  # held-back failure logs answered "nothing found" (19 before stalls were named)
# When the test part grows, the logs held back before keep the floors they had reached, so new,
# harder logs cannot hide a loss on the old ones:
# - batches a-e (74 logs): the first gathering, whose development part the first signatures were
#   written against; batches f-o joined on 2026-12-02;
# - batches a-x (108 logs): batches y-ze (6 held-back logs; one of their 2 catalogued causes is
#   ranked first) moved the all-logs figures from 52.9 / 56.5 / 29.4 % to 52.9 / 56.3 / 28.7 %;
# - batches a-ze (114 logs): batches zf-zg (2 held-back logs; their one catalogued cause is not
#   ranked first) moved them to 52.3 / 55.7 / 28.4 %;
# - batches a-zg (116 logs): batches zh-zi (5 held-back logs; 2 of their 3 catalogued causes are
#   ranked first, neither out-of-catalogue log gets a cause) moved them to 52.7 / 56.0 / 27.5 %;
# - batches a-zi (121 logs): batch zj (1 held-back log, ranked first) and the signatures read from
#   the CUDA, kernel, transfer-engine, UCCL and MSCCL++ sources moved them to 54.3 / 57.6 / 26.1 %,
#   and every earlier part's floor was raised to what it reaches now;
# - batches a-zj (122 logs): batches zl-zm (4 held-back logs; 2 of their 3 catalogued causes are
#   ranked first, the out-of-catalogue log gets no cause) moved them to 54.7 / 57.9 / 26.3 %;
# - batches a-zm (126 logs): batches zn-zo (3 held-back logs; 1 of their 2 catalogued causes is
#   ranked first, and the out-of-catalogue log, a hang without an error line, gets nothing) moved
#   them to 54.6 / 57.7 / 25.8 % with 16 silent;
# - batches a-zp (129 logs): a tear-down notice read after another reference's failure no longer
#   outranks it (after_failure) moved them to 55.7 / 57.7 / 25.8 %, and every earlier part's top-1
#   floor was raised to what it reaches now; batches zq-zt (6 held-back logs; 1 of their 3
#   catalogued causes ranked first, 2 of 3 out-of-catalogue logs given a cause) moved them to
#   55.0 / 57.0 / 26.0 % with 17 silent;
# - batches a-zt (135 logs): batches zu-zz (7 held-back logs; their 3 catalogued causes ranked
#   first, none of their 4 out-of-catalogue logs given a cause) moved them to 56.3 / 58.3 / 25.2 %,
#   and strerror texts and "unable to" as failure words named a line in one silent log of every
#   part, whose silent ceilings went down by one;
# - batches a-zz (142 logs): batches zza-zze (7 held-back logs; their one catalogued cause is not
#   ranked first, none of their 6 out-of-catalogue logs given a cause) moved them to
#   55.8 / 57.7 / 26.0 %;
# - batches a-zze (149 logs): batches zzf-zzi (5 held-back logs; their one catalogued cause is
#   ranked first, none of their 4 out-of-catalogue logs given a cause) moved them to
#   56.2 / 58.1 / 25.7 %;
# - batches a-zzi (154 logs): batches zzj-zzm (7 held-back logs; 1 of their 5 catalogued causes
#   ranked first, neither out-of-catalogue log given a cause, one more silent) moved them to
#   54.5 / 56.4 / 26.4 % with 17 silent;
# - batches a-zzm (161 logs): batches zzn-zzq (6 held-back logs; none of their 4 catalogued causes
#   ranked first, 1 of their 2 out-of-catalogue logs given a cause, one more silent) moved them to
#   52.6 / 54.4 / 28.1 % with 18 silent;
# - batches a-zzzc (184 logs): batches zzzd-zzzg (5 held-back logs; neither of their 2 catalogued
#   causes ranked first, 1 of their 3 out-of-catalogue logs given a cause, one more silent) moved
#   them from 53.3 / 55.8 / 27.5 % with 22 silent to 52.5 / 54.9 / 27.9 % with 23 silent;
# - batches a-zzzg (189 logs): batches zzzh-zzzk (5 held-back logs; 1 of their 2 catalogued causes
#   ranked first, none of their 3 out-of-catalogue logs given a cause) moved them to
#   52.4 / 54.8 / 28.2 % with 23 silent.
# On 2026-12-05 one held-back label of batch i (ColBERT#318, one rank's long clustering while the
# others waited) moved from NCCL003 to NCCL011, the corpus's label for one rank's host-side work:
# every part holding batch i lost that log's top-1 (0.8 to 1.1 points) and its floors moved with it.
# - batches a-zzzk (194 logs): batches zzzl-zzzo (4 held-back logs; neither of their 2 catalogued
#   causes ranked first, neither out-of-catalogue log given a cause, one more silent) moved them
#   to 50.8 / 54.0 / 28.6 % with 24 silent.
# On 2026-12-05 (later) a log ending at a framework's last line before the first collective became
# a stall: one held-back log of batches a-x is no longer silent (24 to 23 in all), and every part's
# silent ceiling and top-3 floor (some had stayed below what they reached) moved to what it reaches.
EARLIER_PARTS = {
    "batches a-e": (set("abcde"), {"top1": 0.596, "top3": 0.645, "no_candidate": 0.21, "silent": 6}),
    "batches a-x": (set("abcdefghijklmnopqrstuvwx"), {"top1": 0.541, "top3": 0.588, "no_candidate": 0.283, "silent": 12}),
    "batches a-ze": (set("abcdefghijklmnopqrstuvwxyz") | {"za", "zb", "zc", "zd", "ze"}, {"top1": 0.54, "top3": 0.586, "no_candidate": 0.276, "silent": 13}),
    "batches a-zg": (set("abcdefghijklmnopqrstuvwxyz") | {"za", "zb", "zc", "zd", "ze", "zf", "zg"}, {"top1": 0.534, "top3": 0.579, "no_candidate": 0.273, "silent": 13}),
    "batches a-zi": (set("abcdefghijklmnopqrstuvwxyz") | {"za", "zb", "zc", "zd", "ze", "zf", "zg", "zh", "zi"}, {"top1": 0.538, "top3": 0.582, "no_candidate": 0.264, "silent": 13}),
    "batches a-zj": (set("abcdefghijklmnopqrstuvwxyz") | {"za", "zb", "zc", "zd", "ze", "zf", "zg", "zh", "zi", "zj"}, {"top1": 0.543, "top3": 0.586, "no_candidate": 0.261, "silent": 13}),
    "batches a-zm": (set("abcdefghijklmnopqrstuvwxyz") | {"za", "zb", "zc", "zd", "ze", "zf", "zg", "zh", "zi", "zj", "zl", "zm"}, {"top1": 0.547, "top3": 0.589, "no_candidate": 0.264, "silent": 13}),
    "batches a-zp": (set("abcdefghijklmnopqrstuvwxyz") | {"za", "zb", "zc", "zd", "ze", "zf", "zg", "zh", "zi", "zj", "zl", "zm", "zn", "zo", "zp"}, {"top1": 0.546, "top3": 0.587, "no_candidate": 0.258, "silent": 14}),
    "batches a-zt": (set("abcdefghijklmnopqrstuvwxyz") | {"za", "zb", "zc", "zd", "ze", "zf", "zg", "zh", "zi", "zj", "zl", "zm", "zn", "zo", "zp", "zq", "zr", "zs", "zt"}, {"top1": 0.54, "top3": 0.58, "no_candidate": 0.26, "silent": 15}),
    "batches a-zz": (set("abcdefghijklmnopqrstuvwxyz") | {"za", "zb", "zc", "zd", "ze", "zf", "zg", "zh", "zi", "zj", "zl", "zm", "zn", "zo", "zp", "zq", "zr", "zs", "zt", "zu", "zv", "zw", "zx", "zy", "zz"}, {"top1": 0.553, "top3": 0.592, "no_candidate": 0.253, "silent": 15}),
    "batches a-zze": (set("abcdefghijklmnopqrstuvwxyz") | {"za", "zb", "zc", "zd", "ze", "zf", "zg", "zh", "zi", "zj", "zl", "zm", "zn", "zo", "zp", "zq", "zr", "zs", "zt", "zu", "zv", "zw", "zx", "zy", "zz", "zza", "zzb", "zzc", "zzd", "zze"}, {"top1": 0.548, "top3": 0.586, "no_candidate": 0.26, "silent": 15}),
    "batches a-zzi": (set("abcdefghijklmnopqrstuvwxyz") | {"za", "zb", "zc", "zd", "ze", "zf", "zg", "zh", "zi", "zj", "zl", "zm", "zn", "zo", "zp", "zq", "zr", "zs", "zt", "zu", "zv", "zw", "zx", "zy", "zz", "zza", "zzb", "zzc", "zzd", "zze", "zzf", "zzg", "zzh", "zzi"}, {"top1": 0.552, "top3": 0.59, "no_candidate": 0.258, "silent": 15}),
    "batches a-zzm": (set("abcdefghijklmnopqrstuvwxyz") | {"za", "zb", "zc", "zd", "ze", "zf", "zg", "zh", "zi", "zj", "zl", "zm", "zn", "zo", "zp", "zq", "zr", "zs", "zt", "zu", "zv", "zw", "zx", "zy", "zz", "zza", "zzb", "zzc", "zzd", "zze", "zzf", "zzg", "zzh", "zzi", "zzj", "zzk", "zzl", "zzm"}, {"top1": 0.536, "top3": 0.572, "no_candidate": 0.264, "silent": 16}),
    "batches a-zzq": (set("abcdefghijklmnopqrstuvwxyz") | {"za", "zb", "zc", "zd", "ze", "zf", "zg", "zh", "zi", "zj", "zl", "zm", "zn", "zo", "zp", "zq", "zr", "zs", "zt", "zu", "zv", "zw", "zx", "zy", "zz", "zza", "zzb", "zzc", "zzd", "zze", "zzf", "zzg", "zzh", "zzi", "zzj", "zzk", "zzl", "zzm", "zzn", "zzo", "zzp", "zzq"}, {"top1": 0.535, "top3": 0.57, "no_candidate": 0.264, "silent": 17}),
    "batches a-zzu": (set("abcdefghijklmnopqrstuvwxyz") | {"za", "zb", "zc", "zd", "ze", "zf", "zg", "zh", "zi", "zj", "zl", "zm", "zn", "zo", "zp", "zq", "zr", "zs", "zt", "zu", "zv", "zw", "zx", "zy", "zz", "zza", "zzb", "zzc", "zzd", "zze", "zzf", "zzg", "zzh", "zzi", "zzj", "zzk", "zzl", "zzm", "zzn", "zzo", "zzp", "zzq", "zzr", "zzs", "zzt", "zzu"}, {"top1": 0.534, "top3": 0.568, "no_candidate": 0.268, "silent": 17}),
    "batches a-zzy": (set("abcdefghijklmnopqrstuvwxyz") | {"za", "zb", "zc", "zd", "ze", "zf", "zg", "zh", "zi", "zj", "zl", "zm", "zn", "zo", "zp", "zq", "zr", "zs", "zt", "zu", "zv", "zw", "zx", "zy", "zz", "zza", "zzb", "zzc", "zzd", "zze", "zzf", "zzg", "zzh", "zzi", "zzj", "zzk", "zzl", "zzm", "zzn", "zzo", "zzp", "zzq", "zzr", "zzs", "zzt", "zzu", "zzv", "zzw", "zzx", "zzy"}, {"top1": 0.521, "top3": 0.554, "no_candidate": 0.278, "silent": 20}),
    "batches a-zzzc": (set("abcdefghijklmnopqrstuvwxyz") | {"za", "zb", "zc", "zd", "ze", "zf", "zg", "zh", "zi", "zj", "zl", "zm", "zn", "zo", "zp", "zq", "zr", "zs", "zt", "zu", "zv", "zw", "zx", "zy", "zz", "zza", "zzb", "zzc", "zzd", "zze", "zzf", "zzg", "zzh", "zzi", "zzj", "zzk", "zzl", "zzm", "zzn", "zzo", "zzp", "zzq", "zzr", "zzs", "zzt", "zzu", "zzv", "zzw", "zzx", "zzy", "zzz", "zzza", "zzzb", "zzzc"}, {"top1": 0.525, "top3": 0.558, "no_candidate": 0.275, "silent": 21}),
    "batches a-zzzg": (set("abcdefghijklmnopqrstuvwxyz") | {"za", "zb", "zc", "zd", "ze", "zf", "zg", "zh", "zi", "zj", "zl", "zm", "zn", "zo", "zp", "zq", "zr", "zs", "zt", "zu", "zv", "zw", "zx", "zy", "zz", "zza", "zzb", "zzc", "zzd", "zze", "zzf", "zzg", "zzh", "zzi", "zzj", "zzk", "zzl", "zzm", "zzn", "zzo", "zzp", "zzq", "zzr", "zzs", "zzt", "zzu", "zzv", "zzw", "zzx", "zzy", "zzz", "zzza", "zzzb", "zzzc", "zzzd", "zzze", "zzzf", "zzzg"}, {"top1": 0.516, "top3": 0.557, "no_candidate": 0.279, "silent": 22}),
    "batches a-zzzk": (set("abcdefghijklmnopqrstuvwxyz") | {"za", "zb", "zc", "zd", "ze", "zf", "zg", "zh", "zi", "zj", "zl", "zm", "zn", "zo", "zp", "zq", "zr", "zs", "zt", "zu", "zv", "zw", "zx", "zy", "zz", "zza", "zzb", "zzc", "zzd", "zze", "zzf", "zzg", "zzh", "zzi", "zzj", "zzk", "zzl", "zzm", "zzn", "zzo", "zzp", "zzq", "zzr", "zzs", "zzt", "zzu", "zzv", "zzw", "zzx", "zzy", "zzz", "zzza", "zzzb", "zzzc", "zzzd", "zzze", "zzzf", "zzzg", "zzzh", "zzzi", "zzzj", "zzzk"}, {"top1": 0.516, "top3": 0.556, "no_candidate": 0.283, "silent": 22}),
}


@pytest.fixture(scope="module")
def held_back() -> list:  # type: ignore[type-arg]
    return evaluate(corpus("test"))


def test_held_back_accuracy_does_not_drop(held_back: list) -> None:  # type: ignore[type-arg]
    result = figures(held_back)
    report = "\n".join(result.lines())
    assert result.top1 >= TOP1_FLOOR, report
    assert result.top3 >= TOP3_FLOOR, report
    assert result.no_candidate <= NO_CANDIDATE_CEILING, report
    assert result.outside_with_cause <= OUTSIDE_CAUSE_CEILING, report
    assert result.silent <= SILENT_CEILING, report
    for name, (batches, floors) in EARLIER_PARTS.items():
        part = figures([outcome for outcome in held_back if outcome.log.id.split("-", 1)[0] in batches])
        report = f"{name} only:\n" + "\n".join(part.lines())
        assert part.top1 >= floors["top1"], report
        assert part.top3 >= floors["top3"], report
        assert part.no_candidate <= floors["no_candidate"], report
        assert part.silent <= floors.get("silent", part.silent), report


def test_corpus_is_as_large_and_broad_as_promised() -> None:
    logs = corpus()
    references = {log.reference for log in logs} - {OUTSIDE}
    assert len([log for log in logs if log.reference != OUTSIDE]) >= 180
    assert len(logs) >= 200
    assert len(references) >= 60
    assert sum(1 for log in logs if log.reference == OUTSIDE) >= 30


def test_split_is_by_thread_and_holds_back_a_third() -> None:
    logs = corpus()
    splits_of_thread: dict[str, set[str]] = collections.defaultdict(set)
    for log in logs:
        splits_of_thread[log.thread].add(log.split)
    assert all(len(splits) == 1 for splits in splits_of_thread.values()), "a thread spans both parts"
    held = sum(1 for splits in splits_of_thread.values() if splits == {"test"})
    assert held * 3 >= len(splits_of_thread) - 1, f"{held} of {len(splits_of_thread)} threads held back"


def test_the_split_was_made_once_and_stands() -> None:
    """Running the split tool again changes no log's part: a held-back log never moves to the
    part signatures are written against, nor back."""
    split = load_script(CORPUS / "split.py")
    entries = [entry for labels in sorted(CORPUS.glob("labels-*.toml")) for entry in tomllib.loads(labels.read_text())["log"]]
    assigned = split.assign(entries)
    assert all(assigned[entry["thread"]] == entry["split"] for entry in entries)
    fresh = [dict(entry, thread=entry["thread"] + "#new") for entry in entries[:6]]
    for entry in fresh:
        del entry["split"]
    dealt = split.assign([*entries, *fresh])
    assert all(dealt[entry["thread"]] == entry["split"] for entry in entries)  # new threads move nobody


def test_every_label_is_complete_and_names_a_real_reference() -> None:
    known = {reference.id for reference in load_all()}
    seen_ids: set[str] = set()
    per_thread = collections.Counter()
    for labels in sorted(CORPUS.glob("labels-*.toml")):
        for entry in tomllib.loads(labels.read_text())["log"]:
            where = f"{labels.name}: {entry.get('id')}"
            assert set(entry) == {"id", "thread", "post", "reference", "outside", "settled", "confidence", "truncated", "split"}, where
            assert re.fullmatch(r"[a-z0-9-]+", entry["id"]) and entry["id"] not in seen_ids, where
            seen_ids.add(entry["id"])
            assert entry["reference"] in known or entry["reference"] == OUTSIDE, where
            assert bool(entry["outside"]) == (entry["reference"] == OUTSIDE), where
            assert entry["settled"].strip() and entry["confidence"] in ("confirmed", "likely"), where
            assert entry["split"] in ("dev", "test"), where
            assert THREAD_URL.fullmatch(entry["thread"]), where
            per_thread[entry["thread"]] += 1
            assert (CORPUS / "logs" / f"{entry['id']}.log").is_file(), where
    assert max(per_thread.values()) <= 3
    on_disk = {path.stem for path in (CORPUS / "logs").glob("*.log")}
    assert on_disk == seen_ids, f"unlabelled logs: {sorted(on_disk - seen_ids)}"


def test_no_failure_log_is_answered_with_silence_when_it_shows_an_error() -> None:
    """A log that shows an error line is never answered "nothing found": it gets a candidate or
    its first failing line is named as uncatalogued."""
    silent = [
        outcome.log
        for outcome in evaluate(corpus())
        if outcome.silent and _shows_an_error(outcome.log.path.read_text(errors="replace"))
    ]
    # Names from the development part only: the held-back logs are not for reading.
    development = [log.id for log in silent if log.split == "dev"]
    held_back = sum(1 for log in silent if log.split == "test")
    assert (development, held_back) == ([], 0)


_ERROR_WORDS = re.compile(r"\b(?:Error|ERROR|error:|Exception|Traceback|WARN|failed|Failed|FAILED|Segmentation fault|Killed)\b")


# A line UCX logs below its DIAG level is information even when it says "failed" (a fallback).
_UCX_INFORMATION = re.compile(r"\bUCX {1,3}(?:INFO|DEBUG|TRACE|REQ|DATA|ASYNC|FUNC|POLL) ")


def _shows_an_error(text: str) -> bool:
    return any(_ERROR_WORDS.search(line) and not _UCX_INFORMATION.search(line) for line in text.splitlines())


def _hard_quote(text: str) -> str:
    return "\n".join("> " + line for line in text.split("\n"))


# What copying a log out of a terminal, a rendered page, a chat or a page's HTML source does to it.
POSTING_MARKS = {
    "quoted": _hard_quote,
    "crlf": lambda text: text.replace("\n", "\r\n"),
    "no-break spaces": lambda text: text.replace(" ", "\u00a0"),
    "html entities": lambda text: text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;"),
    "curly quotes": lambda text: text.replace("'", "\u2019"),
    "coloured": lambda text: "\n".join("\x1b[31m" + line + "\x1b[0m" for line in text.split("\n")),
}


@pytest.fixture(scope="module")
def dev_ranked_right() -> list:  # type: ignore[type-arg]
    return [outcome.log for outcome in evaluate(corpus("dev")) if outcome.top1]


@pytest.mark.parametrize("mark", POSTING_MARKS, ids=str)
def test_posting_marks_do_not_change_the_answer(mark: str, dev_ranked_right: list, tmp_path) -> None:  # type: ignore[no-untyped-def,type-arg]
    """Every development log whose cause ``explain`` ranks first still has it first when the log
    carries the marks of how it was posted (development logs only: the held-back part is read by
    the accuracy test alone)."""
    catalogue = load_catalogue()
    assert len(dev_ranked_right) > 100
    lost = []
    for log in dev_ranked_right:
        posted = tmp_path / f"{log.id}.log"
        posted.write_text(POSTING_MARKS[mark](log.path.read_text(encoding="utf-8", errors="replace")), encoding="utf-8")
        candidates = explain([str(posted)], catalogue=catalogue).candidates
        if not candidates or candidates[0].reference_id != log.reference:
            lost.append(log.id)
    assert lost == []
