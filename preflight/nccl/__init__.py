"""What NCCL itself does, modelled from its source and release notes: how it picks a RoCE GID and
its IB devices, and which releases carry which known bugs. Probes and checks share these models so
that both reason about a node the way NCCL will."""
