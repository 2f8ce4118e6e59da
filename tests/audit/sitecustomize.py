"""Audits the Python processes the test suite starts (see io_audit.py): ``tests/conftest.py``
puts this directory on ``PYTHONPATH`` and names the log in ``IO_AUDIT_LOG``. Outside the suite
neither is set and this does nothing."""

import os

if os.environ.get("IO_AUDIT_LOG"):
    import io_audit

    io_audit.install(os.environ["IO_AUDIT_LOG"])
