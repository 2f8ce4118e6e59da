"""Scan chunks on every core once an input turns out to be large.

Scanning is CPU-bound and chunks are independent, so big logs (a million lines of a 64-rank
job) are shared out to forked worker processes, which inherit the compiled matcher instead of
rebuilding it. Small inputs never pay for a fork: scanning starts in this process and moves to
the pool only after ``PARALLEL_AFTER_BYTES``, or from the start when the files' sizes already say
they are that large (the first megabytes would otherwise be scanned on one core). At most two
chunks per worker are in flight, so memory stays bounded whatever the input size, and hits are
consumed in input order, which the cascade analysis relies on. Wherever a pool cannot be made (no fork, no /dev/shm) or a worker
dies, the chunk is scanned here instead.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
from typing import Any, Iterable, Iterator

from preflight.explain.matcher import Hit, Matcher
from preflight.explain.reader import Chunk, ReadStats

PARALLEL_AFTER_BYTES = 16 << 20
_RESULT_TIMEOUT_S = 120
_MATCHER: Matcher | None = None  # set before forking; workers inherit it


def scan_chunks(
    matcher: Matcher, chunks: Iterable[Chunk], stats: ReadStats, workers: int | None = None, expected_bytes: int = 0
) -> Iterator[Hit]:
    """Every hit of every chunk, in input order. ``expected_bytes`` is what the inputs' sizes
    promise (0 when unknown: stdin, gzip); it only decides when the pool starts."""
    count = workers if workers is not None else min(os.cpu_count() or 1, 4)
    iterator = iter(chunks)
    if count <= 1 or expected_bytes < PARALLEL_AFTER_BYTES:
        for chunk in iterator:
            yield from matcher.scan(chunk)
            if count > 1 and stats.bytes >= PARALLEL_AFTER_BYTES:
                break
        else:
            return
    pool = _start_pool(matcher, count)
    if pool is None:
        for chunk in iterator:
            yield from matcher.scan(chunk)
        return
    try:
        yield from _scan_in_pool(pool, matcher, iterator, count)
    finally:
        pool.terminate()


def _start_pool(matcher: Matcher, count: int) -> Any:
    global _MATCHER
    try:
        context = multiprocessing.get_context("fork")
        _MATCHER = matcher
        return context.Pool(count)
    except (OSError, ValueError, ImportError):
        return None


def _scan_in_pool(pool: Any, matcher: Matcher, chunks: Iterator[Chunk], count: int) -> Iterator[Hit]:
    pending: collections.deque[tuple[Chunk, Any]] = collections.deque()
    for chunk in chunks:
        pending.append((chunk, pool.apply_async(_scan_in_worker, (chunk,))))
        if len(pending) >= 2 * count:
            yield from _collect(matcher, *pending.popleft())
    while pending:
        yield from _collect(matcher, *pending.popleft())


def _collect(matcher: Matcher, chunk: Chunk, result: Any) -> Iterator[Hit]:
    try:
        found = result.get(_RESULT_TIMEOUT_S)
    except Exception:  # a worker died or hung: scan the chunk here rather than lose it
        yield from matcher.scan(chunk)
        return
    for number, line_number, text in found:
        yield Hit(matcher.signatures[number], chunk.source, line_number, text)


def _scan_in_worker(chunk: Chunk) -> list[tuple[int, int, str]]:
    assert _MATCHER is not None
    position = {id(signature): number for number, signature in enumerate(_MATCHER.signatures)}
    return [(position[id(hit.signature)], hit.line_number, hit.text) for hit in _MATCHER.scan(chunk)]
