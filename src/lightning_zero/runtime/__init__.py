"""What both front doors (the Trainer strategy in ``trainer/``, the Fabric strategy in ``fabric/``) call:
the mesh and engine set-up (``setup``), a checkpoint restore across the door's calls (``restore``),
throughput arithmetic for the monitor (``throughput``). No ``lightning.pytorch`` here."""
