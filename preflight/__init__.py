"""preflight: find GPU/RDMA node misconfigurations before a job starts."""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# msgspec uses typing_extensions when it is installed (typer brings it) for what Python >= 3.10's
# own typing has (get_type_hints(include_extras=True); Required/NotRequired, which no record here
# uses), and typing_extensions imports inspect, ast, dis and tokenize: ~8 ms before every job.
# Hidden while msgspec loads, it falls back to typing; whoever imports typing_extensions later
# (the typer application) gets the real one.
#
# msgspec also imports uuid, and uuid imports platform only to call platform.system() once at
# import (is this AIX or Linux?); platform itself compiles a dozen regular expressions and imports
# more: 17M instructions, about 3 ms, before every job. While msgspec loads, a stand-in answers
# that one call from os.uname(); uuid never uses the name again, and a later ``import platform``
# gets the real module.
if "msgspec" not in _sys.modules and "typing_extensions" not in _sys.modules:
    _hidden: dict[str, object] = {"typing_extensions": None}
    if "platform" not in _sys.modules and "uuid" not in _sys.modules:
        import types as _types

        _platform = _types.ModuleType("platform", "stand-in while msgspec imports uuid (preflight/__init__.py)")
        _platform.system = lambda: _os.uname().sysname  # type: ignore[attr-defined]
        _hidden["platform"] = _platform
    _sys.modules.update(_hidden)  # type: ignore[arg-type]
    try:
        import msgspec as _msgspec  # noqa: F401
    finally:
        for _name in _hidden:
            del _sys.modules[_name]

# An installed copy has checks/ inside the package; a checkout has it beside (preflight.sourcetree).
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "checks")):
    from preflight.sourcetree import map_checkout

    map_checkout(_os.path.dirname(__file__))
