"""Assign the development/test split of the real-log corpus, once, by thread.

A log that already has a ``split`` keeps it; a thread seen before keeps its split for new logs;
only threads never seen get one. New threads are dealt out reference by reference, in a fixed
order (SHA-256 of the thread URL), with one counter running across all references: every third
thread goes to the held-back test part, so a third of the threads (rounded up) end up there and
each reference's threads are spread over both parts.

    python tests/data/real-logs/split.py      # rewrites labels-*.toml in place, adding split = ...
"""

from __future__ import annotations

import hashlib
import re
import sys
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEST_SHARE = 3  # every third new thread goes to the test part


def thread_key(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()


def assign(logs: list[dict[str, object]]) -> dict[str, str]:
    """The split of every thread: kept where a log already has one, dealt for new threads."""
    split_of: dict[str, str] = {}
    for entry in logs:
        if "split" in entry:
            split_of.setdefault(str(entry["thread"]), str(entry["split"]))
    new_threads: dict[str, list[str]] = {}
    for entry in logs:
        thread, reference = str(entry["thread"]), str(entry["reference"])
        if thread not in split_of and all(thread not in bucket for bucket in new_threads.values()):
            new_threads.setdefault(reference, []).append(thread)
    dealt = len(split_of)  # keeps the rhythm when threads are added
    for reference in sorted(new_threads):
        for thread in sorted(new_threads[reference], key=thread_key):
            split_of[thread] = "test" if dealt % TEST_SHARE == 0 else "dev"
            dealt += 1
    return split_of


def main() -> int:
    files = sorted(HERE.glob("labels-*.toml"))
    logs = [entry for path in files for entry in tomllib.loads(path.read_text())["log"]]
    split_of = assign(logs)
    for path in files:
        text = path.read_text()
        text = re.sub(r'\n(split = "[a-z]+"\n)', "\n", text)  # rewritten below from split_of
        out = []
        for block in re.split(r"(?m)^(?=\[\[log\]\])", text):
            thread = re.search(r'(?m)^thread = "([^"]+)"', block)
            if thread:
                block = block.rstrip("\n") + f'\nsplit = "{split_of[thread.group(1)]}"\n\n'
            out.append(block)
        path.write_text("".join(out).rstrip("\n") + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
