"""The Trainer's front door: ``ZeroStrategy`` and the Lightning glue around it (precision plugin,
monitor callback, the failure notice, the parameter-gather barrier). Everything here may import
``lightning.pytorch``; the engine it drives (``zero/``, ``tp/``, ``comm/``) never does."""
