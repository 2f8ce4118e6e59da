"""The command layer: one module per command (``node``, ``snapshot``, ``explain``,
``references``, ``probes``, ``fleet``, ``slurm``), each declaring its options once
(:mod:`preflight.cli.spec`); :mod:`preflight.cli.start` is the console entry and
:mod:`preflight.cli.app` the typer application built from the same declarations."""
