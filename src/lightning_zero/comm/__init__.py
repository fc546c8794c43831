"""Collectives and the mesh under the engine (plain torch.distributed, no Lightning): every collective
labelled and counted (``collectives``), their ring byte counts (``ring``), compressed gradient and
parameter traffic (``compression``), and the ``(replicate, shard, tp)`` layout (``mesh``)."""
