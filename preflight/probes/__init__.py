"""Probes: each module gathers one subsystem's facts from the node's sources and parses them.

A probe module holds its facts (typed records), the parsers that build them from kernel, driver and
configuration formats, and the ``@probe`` function; it never judges. Checks (``checks/<family>.py``)
receive the facts by the probe's name. A probe that builds on another probe's facts names that
probe as a parameter and the engine hands them over, so every fact is read once per run.
"""
