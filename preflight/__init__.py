"""preflight: find GPU/RDMA node misconfigurations before a job starts."""

import os as _os

__version__ = "0.1.0"

# An installed copy has checks/ inside the package; a checkout has it beside (preflight.sourcetree).
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "checks")):
    from preflight.sourcetree import map_checkout

    map_checkout(_os.path.dirname(__file__))
