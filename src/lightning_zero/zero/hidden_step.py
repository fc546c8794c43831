"""The wrapped optimizer's own ``step`` loop sees no parameters; the wrapper steps them in its post-hook.

Stage 3's replicated step (``stage3/replicated_step.py``) and the matrix owners' step
(``matrix_optimizer.py``) both keep the user's optimizer object (schedulers, hyperparameters in
``param_groups``) but run its arithmetic themselves: a step pre-hook lets a closure (forward,
backward, clipping) see the param groups, then empties them so the optimizer's own loop does
nothing, and the post-hook that steps them puts them back.
"""

from __future__ import annotations

from typing import Any, Optional

from torch.optim import Optimizer


class HiddenFromOwnStep:
    """Mixin for a ShardedOptimizer whose ``_params_per_group`` its own post-hook steps."""

    optimizer: Optimizer
    _params_per_group: list[list[Any]]

    def _register_hiding(self) -> None:
        self._hiding_hook = self.optimizer.register_step_pre_hook(self._before_step)

    def _show_params(self) -> None:
        for param_group, params in zip(self.optimizer.param_groups, self._params_per_group):
            param_group["params"] = params

    def _hide_params(self) -> None:
        for param_group in self.optimizer.param_groups:
            param_group["params"] = []

    def _before_step(self, optimizer: Optimizer, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        """Let the closure (zero_grad, backward, clipping) see the params; the optimizer's own
        loop then sees none (the post-hook steps them)."""
        self._show_params()  # a step that raised left them hidden
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._hide_params()
            return None

        def closure_then_hide() -> Any:
            loss = closure()
            self._hide_params()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_hide}
        return (args[0], closure_then_hide, *args[2:]), kwargs

    def _remove_hiding(self) -> None:
        self._hiding_hook.remove()
        self._show_params()
