"""preflight: find GPU/RDMA node misconfigurations before a job starts."""

__version__ = "0.1.0"
