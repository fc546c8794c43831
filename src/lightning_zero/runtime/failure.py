"""What a rank does when it or a peer fails, for both doors: tell the others, then issue no collective.

[Note: failure path] A failure must end every rank within seconds, naming the rank that failed,
whichever door ran the loop. Under ZeRO much of what a loop does around an exception wants every
rank (a sharded save, a barrier, stage 3's unshard at teardown, the stage 1-2 parameter gathers
still in flight): a rank that enters them alone waits forever for peers that are blocked in the
step's own collectives. So:

1. The door learns of the failure first (the Trainer: in its step methods and in the first
   callback's ``on_exception``, ``trainer/failure_path.py``; Fabric: in the forward and backward of
   the set-up model and in the optimizer step, ``runtime/forward_steps.py``). The failing rank posts its
   exception on the failure channel ([Note: failure channel] in ``zero/waits.py``) with
   :func:`note_failure`; a rank whose error says that a collective failed first looks for a peer's
   message and, finding one, rewrites its own error to name the failing rank (the user's error is
   never rewritten).
2. From then on this rank issues no collective: a sharded save (the last complete checkpoint stays
   the newest) and barriers are skipped with a warning (:func:`warn_failed`), and the engine is
   closed without what needs the peers (``ZeroSession.close_engine``): the module is left as it
   is, and the warning says so.
3. A rank that failed itself waits, before its peers raise, until it printed its traceback (an
   ``atexit`` note; at most ``REPORTED_GRACE_S``), so the user reads the real error first.

No ``lightning.pytorch`` here: where the failure happened arrives as words (``where``).
"""

from __future__ import annotations

import re
import warnings
from typing import Optional

import torch.distributed as dist

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
    if previous is not None:
        previous.close()
    nccl = dist.get_backend() == "nccl"
    return FailureChannel.open(on_peer_failure=abort_nccl_after() if nccl else None)


def is_collective_error(exception: BaseException) -> bool:
    """Whether ``exception`` says that a collective (not the user's code) failed."""
    if isinstance(exception, (CollectiveTimeoutError, PeerFailedError, dist.DistError)):
        return True
    if isinstance(exception, ValueError):
        return bool(_GROUP_GONE.search(str(exception)))
    return isinstance(exception, RuntimeError) and bool(_COLLECTIVE_ERROR.search(str(exception)))


def note_failure(channel: Optional[FailureChannel], exception: BaseException, where: str) -> None:
    """Step 1 of [Note: failure path] for ``exception`` raised on this rank ``where`` ("training
    step 3"); idempotent."""
    if channel is None or getattr(exception, "_lightning_zero_noted", False):
        return
    exception._lightning_zero_noted = True  # type: ignore[attr-defined]
    if isinstance(exception, PeerFailedError):
        channel.await_reported()
        return
    collective = is_collective_error(exception)
    peer = (channel.peer_error() or channel.await_peer_error()) if collective else None
    if peer is None:  # this rank's own failure: posted; the user's error is never rewritten
        message = f"{type(exception).__name__}: {exception} (on global rank {channel.rank}, during {where})"
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


def warn_failed(channel: Optional[FailureChannel], global_rank: int, what: str) -> None:
    """Step 2 of [Note: failure path]: say what this rank skipped (``what``) and why."""
    peer = channel.peer_failure if channel is not None else None
    cause = f"global rank {peer[0]} failed" if peer is not None else "this rank failed"
    warnings.warn(f"lightning_zero (global rank {global_rank}): {cause}; {what}.", stacklevel=2)
