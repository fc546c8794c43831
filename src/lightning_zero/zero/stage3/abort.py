"""How stage 3 stops every rank when one finds the ranks out of step, instead of a hang.

[Note: abort channel] A divergence found after the first step raises on the rank that found it,
which posts the message on the engine's failure channel first ([Note: failure channel] in
``zero/waits.py``); ranks waiting on an all-gather read it within one poll and raise it, naming
module, step and rank. With ``collective_timeout`` a gloo all-gather wait that runs out raises
naming the unit, and posts that message for the other ranks too. On NCCL (no host-side polling)
the failure channel's abort ends a wait stuck on the failed rank.
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn

from lightning_zero.zero.waits import CollectiveTimeoutError, Waiter


class AbortChannel:
    """The stage-3 runtime's waits and raises, both through the engine's failure channel.

    Args:
        waiter: how a collective is waited on (``collective_timeout``, polling, the failure channel).
        where: the runtime's position, for messages: ``"during <phase> of step <n> on dp rank <r>"``.
    """

    def __init__(self, waiter: Waiter, where: Callable[[], str]) -> None:
        self.waiter = waiter
        self.where = where

    def abort(self, message: str) -> NoReturn:
        """Raise ``message`` here and make every rank waiting on an all-gather raise it too."""
        if self.waiter.failure is not None:
            self.waiter.failure.post(message)
        raise RuntimeError(message)

    def wait(self, work: Any, what: str = "a stage-3 agreement") -> None:
        """Wait on ``work``; a time-out raises here and is posted for the other ranks."""
        try:
            self.waiter.wait(work, lambda: f"{what} {self.where()}")
        except CollectiveTimeoutError as err:  # the peers stop too, naming what this rank waited on
            if self.waiter.failure is not None:
                self.waiter.failure.post(str(err))
            raise
