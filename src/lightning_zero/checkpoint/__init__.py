"""Sharded checkpoints: every rank writes what it owns, any layout reads them, one command exports them.

A checkpoint is a directory (Lightning's ``*.ckpt`` path becomes a directory)::

    epoch=0-step=4.ckpt/
      meta.json            format, saved layout, parameter names and dense shapes, optimizer
                           hyperparameters, Lightning's non-tensor state (JSON, see
                           [Note: state codec] in ``checkpoint/state.py``), sha256 of every file below
      .metadata            DCP's index of every saved rectangle (read with a restricted unpickler)
      __<rank>_0.distcp    the tensors rank <rank> owned: fp32 master values and optimizer state
      rank<rank>.json      that rank's RNG states

Tensors are keyed ``model.<name>`` (fp32 master values of parameters the optimizer steps; other
entries of the module's state dict as they are) and ``optim.<i>.<name>.<key>`` (state ``key`` of
optimizer ``i``, e.g. ``exp_avg``, for the elements of parameter ``name``; scalars such as Adam's
``step`` are stored once per parameter), all in dense coordinates (see
[Note: dense coordinates] in ``checkpoint/dcp.py``), so a load at another dp, tp or ZeRO stage
just reads other rectangles.

[Note: atomic publish] Ranks write into a staging directory next to the target
(``.lightning_zero-staging-<token>-<hex of the name>``: [Note: staging names] in ``publish.py``).
When every rank has written and hashed its files (an all-gather of the per-rank file lists), rank
0 writes ``meta.json`` last, syncs the staging directory, and swaps it with any previous checkpoint
of that name in one ``renameat2(RENAME_EXCHANGE)`` (Linux; the old one then sits under the staging
name and is deleted), so there is no moment without the target; where the exchange is not
available it moves the previous one aside (under a ``.lightning_zero-retired-`` name) and renames
the staging directory into place. The parent directory is synced before the old one is deleted
and before the save counts as published (every file was synced when written). A directory
without ``meta.json``, or under a staging/retired name, is never a checkpoint, and no such name
matches what Lightning scans for (``hpc_ckpt_*``, ``last*.ckpt``), so a run killed mid-write leaves
the previous checkpoint as the last one. When and by whom this runs: [Note: checkpoint lifecycle]
in ``runtime/checkpoints.py``.

The package, one job a module: ``dcp`` (how owned ranges become DCP chunks; safe metadata
reading), ``targets`` (which tensors a rank holds), ``publish`` (temporary directory, hashes, the
atomic rename), ``save``, ``load`` (verify, strict fit check, read into any layout), ``state``
(non-tensor state as JSON), ``ranks`` (agreement across ranks), ``export`` (one plain state dict;
a model family's own layout, such as ``models/llama/hf.py``'s Hugging Face export, builds on its
``assemble``) and ``hf`` (reading and writing safetensors weight directories). No module here
knows a model family: models import ``checkpoint``, never the reverse.

Loading verifies every file's size and sha256 against ``meta.json`` (spread over the ranks)
before anything is read into the model; a failure names the file and changes nothing.
"""

from lightning_zero.checkpoint.dcp import CheckpointError
from lightning_zero.checkpoint.export import export
from lightning_zero.checkpoint.load import (
    OpenedCheckpoint,
    apply_optimizer_state,
    is_checkpoint,
    load_model,
    open_checkpoint,
    refuse_plain_load,
    restore_rng,
)
from lightning_zero.checkpoint.publish import CheckpointWriteError, remove_checkpoint
from lightning_zero.checkpoint.save import save_checkpoint
from lightning_zero.checkpoint.targets import RankPlacement

__all__ = [
    "CheckpointError",
    "CheckpointWriteError",
    "OpenedCheckpoint",
    "RankPlacement",
    "apply_optimizer_state",
    "export",
    "is_checkpoint",
    "load_model",
    "open_checkpoint",
    "refuse_plain_load",
    "remove_checkpoint",
    "restore_rng",
    "save_checkpoint",
]
