"""Expert parallelism: ``dispatch`` (tokens to their experts' ranks and back by uneven
all-to-all, forward and backward) and ``parallelize`` (``parallelize_experts``: keep this rank's
experts, wire the ``ep`` group into every MoE layer)."""
