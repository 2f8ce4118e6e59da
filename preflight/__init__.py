"""preflight: find GPU/RDMA node misconfigurations before a job starts."""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# msgspec uses typing_extensions when it is installed (typer brings it) for what Python >= 3.10's
# own typing has (get_type_hints(include_extras=True); Required/NotRequired, which no record here
# uses), and typing_extensions imports inspect, ast, dis and tokenize: ~8 ms before every job.
# Hidden while msgspec loads, it falls back to typing; whoever imports typing_extensions later
# (the typer application) gets the real one.
if "msgspec" not in _sys.modules and "typing_extensions" not in _sys.modules:
    _sys.modules["typing_extensions"] = None  # type: ignore[assignment]
    try:
        import msgspec as _msgspec  # noqa: F401
    finally:
        del _sys.modules["typing_extensions"]

# An installed copy has checks/ inside the package; a checkout has it beside (preflight.sourcetree).
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "checks")):
    from preflight.sourcetree import map_checkout

    map_checkout(_os.path.dirname(__file__))
