"""Expert parallelism, generic: ``dispatch`` (tokens to their experts' ranks and back by uneven
all-to-all, forward and backward). Splitting a family's experts over the ``ep`` group lives beside
the family (``models/moe/parallelize.py``: ``parallelize_experts``), importing this package."""
