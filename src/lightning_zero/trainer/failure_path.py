"""What ZeroStrategy does when a rank fails: tell the others, then issue no collective (Lightning glue).

[Note: failure path] Lightning handles an exception of ``fit``/``validate`` in one place
(``_call_and_handle_interrupt``): every callback's ``on_exception`` (ModelCheckpoint's
save-on-exception among them), the strategy's ``on_exception``, the loggers, then the strategy's
``teardown``, and it re-raises. Under ZeRO several of those want every rank (a sharded save, the
barrier after it, stage 3's unshard at teardown, the stage 1-2 parameter gathers still in flight):
a rank that enters them alone waits forever for peers that are blocked in the training step's
own collectives. So:

1. The strategy learns of the failure first: in ``training_step``/``validation_step`` (the
   exception passes through the strategy) and in the ``on_exception`` of :class:`FailureNotice`,
   the first callback, before ModelCheckpoint's. The failing rank posts its exception on the
   failure channel ([Note: failure channel] in ``zero/waits.py``); a rank whose error says that a
   collective failed first looks for a peer's message and, finding one, rewrites its own error
   to name the failing rank (the user's error is never rewritten).
2. From then on this rank issues no collective: ``save_checkpoint`` (a sharded checkpoint needs
   every rank; the last complete one stays the newest) and ``barrier`` are skipped with a
   warning, and ``teardown`` removes the engine's hooks but skips what needs the peers (stage 3's
   unshard, the fp32 masters' gather, waits on gathers in flight, destroying process groups):
   the module is left as it is, and the warning says so.
3. A rank that failed itself waits, before its peers raise, until it printed its traceback
   (an ``atexit`` note; at most ``REPORTED_GRACE_S``), so the user reads the real error first.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

from lightning.pytorch.callbacks import Callback

from lightning_zero.zero.waits import CollectiveTimeoutError, FailureChannel, PeerFailedError, abort_nccl_after

# What a collective says when its peer went away (gloo / NCCL / the store), in any case.
_COLLECTIVE_ERROR = re.compile(
    r"Connection (closed|reset)|Broken pipe|NCCL|gloo|ProcessGroup|c10d|timed out|abort", re.IGNORECASE
)
# What the next torch.distributed call says after the NCCL abort cleared the groups ([Note: NCCL
# abort] in zero/waits.py): "Default process group has not been initialized", "Invalid process
# group specified or has been destroyed".
_GROUP_GONE = re.compile(r"process group has not been initialized|process group specified|been destroyed", re.I)


def open_failure_channel(previous: Optional[FailureChannel]) -> FailureChannel:
    """This rank's failure channel ([Note: failure channel] in ``zero/waits.py``), once the process
    group is up; ``previous`` (a channel of an earlier setup) is closed first."""
    import torch.distributed as dist

    if previous is not None:
        previous.close()
    nccl = dist.get_backend() == "nccl"
    return FailureChannel.open(on_peer_failure=abort_nccl_after() if nccl else None)


def is_collective_error(exception: BaseException) -> bool:
    """Whether ``exception`` says that a collective (not the user's code) failed."""
    import torch.distributed as dist

    if isinstance(exception, (CollectiveTimeoutError, PeerFailedError, dist.DistError)):
        return True
    if isinstance(exception, ValueError):
        return bool(_GROUP_GONE.search(str(exception)))
    return isinstance(exception, RuntimeError) and bool(_COLLECTIVE_ERROR.search(str(exception)))


def where(trainer: Any) -> str:
    """Where a failure happened, in the loop's words ("training step 3", "validation")."""
    if trainer is None:
        return "setup"
    if trainer.training:
        return f"training step {trainer.global_step + 1}"
    stage = getattr(trainer.state.stage, "value", None)
    return f"{stage} (after training step {trainer.global_step})" if stage else "setup"


def note_failure(channel: Optional[FailureChannel], exception: BaseException, trainer: Any) -> None:
    """Step 1 of [Note: failure path] for ``exception`` raised on this rank (idempotent)."""
    if channel is None or getattr(exception, "_lightning_zero_noted", False):
        return
    exception._lightning_zero_noted = True  # type: ignore[attr-defined]
    if isinstance(exception, PeerFailedError):
        channel.await_reported()
        return
    collective = is_collective_error(exception)
    peer = (channel.peer_error() or channel.await_peer_error()) if collective else None
    if peer is None:  # this rank's own failure: posted; the user's error is never rewritten
        message = f"{type(exception).__name__}: {exception} (on global rank {channel.rank}, during {where(trainer)})"
        # a lost-peer error without a peer's line: a rank died without a word, and will not read it
        channel.post(message, peers_alive=not collective or isinstance(exception, CollectiveTimeoutError))
        return
    channel.await_reported()
    _rewrite(exception, f"{peer} -- this rank's own error, a consequence: {exception}")


def _rewrite(exception: BaseException, message: str) -> None:
    """Put ``message`` in ``exception`` (the type stays, so ``except`` clauses still match)."""
    try:
        exception.args = (message,)
    except Exception:  # noqa: BLE001 - an exception type that refuses: leave it as it is
        pass


class FailureNotice(Callback):
    """First in ``trainer.callbacks``: tells the strategy of a failure before any other
    ``on_exception`` hook (ModelCheckpoint's save) runs ([Note: failure path])."""

    def __init__(self, notice: Callable[[BaseException], None]) -> None:
        self.notice = notice

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.notice(exception)


def warn_failed(channel: Optional[FailureChannel], global_rank: int, what: str) -> None:
    """Step 2 of [Note: failure path]: say what this rank skipped (``what``) and why."""
    import warnings

    peer = channel.peer_failure if channel is not None else None
    cause = f"global rank {peer[0]} failed" if peer is not None else "this rank failed"
    warnings.warn(f"lightning_zero (global rank {global_rank}): {cause}; {what}.", stacklevel=2)


def check_step_output(output: Any, module: Any, *, world_size: int, global_rank: int) -> None:
    """A ``training_step`` that returns no loss makes Lightning skip this rank's backward and
    optimizer step; its peers would wait for this rank's reduce-scatters forever. Raise now
    (the failure path ends every rank within seconds) with the fix."""
    if world_size == 1 or module is None or not module.automatic_optimization:
        return
    loss = output.get("loss") if isinstance(output, dict) else output
    if loss is None:
        raise RuntimeError(
            f"lightning_zero: training_step returned no loss on global rank {global_rank} at step"
            f" {module.trainer.global_step + 1}. Lightning then skips this rank's backward and optimizer"
            " step, while the other ranks wait in that step's gradient collectives. Under ZeroStrategy"
            " every rank must take part in every step: to skip a batch, return a zero loss on every rank"
            " that needs it (e.g. `return loss * 0`)."
        )
