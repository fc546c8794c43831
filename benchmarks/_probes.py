"""What each benchmark rank measures: its core, its step times, the bytes its collectives send,
the model-state bytes it holds.

[Note: benchmark probes] Each rank:

- pins itself to its own core (``os.sched_setaffinity``) and uses one torch thread;
- times every optimizer step (``on_train_batch_start`` -> ``on_train_batch_end``; the first
  ``--warmup`` steps are dropped), in wall seconds and in the CPU seconds the whole process used
  (``time.process_time()``: every thread, gloo's included). On a core of its own a rank's wall time
  is its CPU time plus the time it sat idle waiting for its peer; the CPU time moves less with
  the host's load than the wall time does. It also counts the minor page faults of each timed
  step (``ru_minflt``): on CPU the allocator handing pages back and faulting them in again is a
  cost of its own (docs/performance.md, "Training on CPU");
- counts the logical bytes its collectives send in the timed steps (see [Note: logical bytes] in
  ``lightning_zero/comm/collectives.py``), by wrapping the ``torch.distributed`` tensor collectives
  (:class:`CollectiveTap`), which our engine, FSDP and DeepSpeed call from Python; DDP's C++
  reducer calls gloo past the tap, so its bytes come from its own bucket sizes;
- in one extra, untimed *probe* step at the end, counts the model-state bytes it holds (params,
  grads, optimizer state: the live tensors, deduplicated by storage) at three points: after
  forward, before the optimizer step, after it. Per kind the reported value is the largest of
  the three, and ``total`` the largest sum at one point;
- where a benchmark asks (``measure_activations``), counts in that probe step the activation bytes
  its forward keeps for backward (``training_step`` start to ``on_before_zero_grad``, see
  [Note: measuring saved activations] in ``lightning_zero/planner/saved_activations.py``);
- writes ``<case>.rank<r>.json``, which the driver merges into the table and ``--out`` JSON.
"""

from __future__ import annotations

import gc
import os
import resource
import statistics
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

# --------------------------------------------------------------------------------------------
# Process setup
# --------------------------------------------------------------------------------------------


def pin_rank_to_core() -> int:
    """Pin this process to core ``local_rank % cores`` and use one torch thread; returns the core
    (``lightning_zero.planner.bench_model.pin_to_core``, as the calibration pins)."""
    from lightning_zero.planner.bench_model import pin_to_core

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # The cores the job may use, before this process pins itself (a rank that Lightning's launcher
    # starts inherits its parent's pinned mask: BENCH_CORES, set before pinning, travels to it).
    if "BENCH_CORES" not in os.environ:
        os.environ["BENCH_CORES"] = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    return pin_to_core(local_rank, [int(c) for c in os.environ["BENCH_CORES"].split(",")])


def rss_bytes(field: str = "VmRSS") -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process from ``/proc/self/status``."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --------------------------------------------------------------------------------------------
# Counting what collectives send
# --------------------------------------------------------------------------------------------

# name in torch.distributed -> (kind, which tensor argument the count is taken from); the bytes
# one rank sends are lightning_zero.comm.ring.ring_sent(kind, that tensor's bytes, group size)
_RING = {
    "all_reduce": ("all_reduce", 0),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "_reduce_scatter_base": ("reduce_scatter", 1),
    "all_gather_into_tensor": ("all_gather", 0),
    "all_gather_single": ("all_gather", 0),
    "_all_gather_base": ("all_gather", 0),
    "broadcast": ("broadcast", 0),
    # our reduce-scatter and pair all-gather on gloo ([Note: reduce-scatter on gloo], [Note:
    # all-gather on gloo] in collectives.py) and the compressed collectives: (n-1)/n of the input
    # leaves each rank; with split sizes, the rows sent to the other ranks
    "all_to_all_single": ("all_to_all", 1),
}


def _tensor_bytes(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value)
    return 0


_TAP: list["CollectiveTap"] = []  # the one tap of this process, once installed


def collective_tap() -> "CollectiveTap":
    """This process's :class:`CollectiveTap`, installed on the first call. A worker calls it before
    anything imports ``lightning_zero`` (:func:`bench_main`), so the library binds the wrappers."""
    if not _TAP:
        _TAP.append(CollectiveTap().install())
    return _TAP[0]


class CollectiveTap:
    """Wraps ``torch.distributed``'s tensor collectives to count logical bytes sent while ``active``.

    Installed before any strategy module is imported, so modules that bind a collective at
    import time bind the wrapper. A collective that calls another one (a deprecated name
    forwarding to the new one) is counted once. ``all_gather`` / ``reduce_scatter`` with tensor
    lists count ``(n-1)/n`` of the list's bytes.
    """

    def __init__(self) -> None:
        self.active = False
        self.bytes: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._depth = threading.local()

    def install(self) -> "CollectiveTap":
        import torch.distributed as dist

        table = dict(_RING)
        table["all_gather"] = ("all_gather", 0)
        table["reduce_scatter"] = ("reduce_scatter", 1)
        for name, (kind, arg) in table.items():
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(original, kind, arg))
        return self

    def _wrap(self, original: Callable, kind: str, arg: int) -> Callable:
        tap = self

        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(tap._depth, "value", 0)
            if tap.active and depth == 0:
                import torch.distributed as dist

                from lightning_zero.comm.ring import ring_sent  # not at import: the tap goes in first

                tensor = args[arg] if len(args) > arg else next(iter(kwargs.values()), None)
                group = kwargs.get("group")
                if group is None:
                    group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
                n = dist.get_world_size(group)
                splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
                if kind == "all_to_all" and splits:  # rows to each rank; the own rank's stay here
                    row_bytes = _tensor_bytes(tensor) / max(1, tensor.shape[0])
                    own = dist.get_rank(group)
                    sent = row_bytes * sum(size for rank, size in enumerate(splits) if rank != own)
                else:
                    sent = ring_sent(kind, _tensor_bytes(tensor), n)
                tap.bytes[kind] = tap.bytes.get(kind, 0.0) + sent
                tap.calls[kind] = tap.calls.get(kind, 0) + 1
            tap._depth.value = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                tap._depth.value = depth

        counted.__wrapped__ = original  # type: ignore[attr-defined]
        return counted

    def total(self) -> float:
        return sum(self.bytes.values())


# --------------------------------------------------------------------------------------------
# Counting model-state bytes
# --------------------------------------------------------------------------------------------


class StorageLedger:
    """Bytes of distinct tensor storages, each counted once across every kind."""

    def __init__(self) -> None:
        self._seen: set[int] = set()
        self.bytes: dict[str, int] = {}

    def add(self, kind: str, tensors: Iterable[Any]) -> None:
        import torch

        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                continue
            try:
                storage = tensor.untyped_storage()
                nbytes, pointer = storage.nbytes(), storage.data_ptr()
            except RuntimeError:  # a freed (resized-away) storage, e.g. FSDP2's unsharded param
                continue
            if nbytes == 0 or pointer in self._seen:
                continue
            self._seen.add(pointer)
            self.bytes[kind] = self.bytes.get(kind, 0) + nbytes


def optimizer_state_tensors(optimizer: Any) -> list[Any]:
    return [
        value for state in optimizer.state.values() for value in state.values() if hasattr(value, "untyped_storage")
    ]


def live_tensor_bytes() -> int:
    """Bytes of every distinct storage a Python-visible tensor holds (C++-only tensors are missed)."""
    import torch

    ledger = StorageLedger()
    with warnings.catch_warnings():  # isinstance() on deprecated torch.distributed aliases warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    ledger.add("all", tensors)
    return ledger.bytes.get("all", 0)


# --------------------------------------------------------------------------------------------
# The per-rank callback
# --------------------------------------------------------------------------------------------


def make_probe(
    *,
    warmup: int,
    tap: CollectiveTap,
    state_bytes: Callable[[Any], dict[str, int]],
    extra_step: Optional[Callable[[Any], dict[str, float]]] = None,
    at_end: Optional[Callable[[Any], dict[str, Any]]] = None,
    profile_path: Optional[Path] = None,
    measure_activations: bool = False,
) -> Any:
    """A Lightning callback timing steps, counting sent bytes and (last step) model-state bytes.

    Steps run in this order: ``warmup`` untimed, the timed ones, with ``profile_path`` one
    untimed step under ``torch.profiler`` (its op table is written there), and the probe step.

    ``state_bytes(trainer)`` returns ``{"params", "grads", "optimizer"}`` bytes this rank holds;
    ``extra_step(trainer)`` adds per-step numbers (our engine's overlap timeline);
    ``at_end(trainer)`` runs at ``on_train_end``, while the strategy still holds its engine or
    wrapper, and its dict lands in the summary as ``end``; ``measure_activations``: the probe
    step also counts the activation bytes forward keeps for backward (``saved_activation_bytes``).
    """
    from lightning.pytorch.callbacks import Callback

    class StepProbe(Callback):
        def __init__(self) -> None:
            self.step_s: list[float] = []
            self.cpu_s: list[float] = []  # process CPU seconds per timed step (all threads)
            self._cpu_start = 0.0
            self.minor_faults: list[int] = []  # minor page faults per timed step (this process)
            self._faults_start = 0
            self.sent: list[dict[str, float]] = []
            self.extra: list[dict[str, float]] = []
            self.states: dict[str, dict[str, int]] = {}
            self.live_bytes = 0
            self.saved_activation_bytes: Optional[int] = None
            self._saved: Any = None  # lightning_zero.planner.saved_activations.SavedActivations, probe step
            self.end: dict[str, Any] = {}
            self._start = 0.0
            self._role = "warmup"
            self._profiler: Any = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            step, last = trainer.global_step, trainer.max_steps - 1
            if step == last:
                self._role = "probe"
            elif profile_path is not None and step == last - 1:
                self._role = "profile"
                from torch.profiler import ProfilerActivity, profile

                self._profiler = profile(activities=[ProfilerActivity.CPU])
                self._profiler.__enter__()
            else:
                self._role = "timed" if step >= warmup else "warmup"
            self._probing = self._role == "probe"
            tap.active = self._role == "timed"
            tap.bytes.clear()
            tap.calls.clear()
            if self._probing and measure_activations:
                from lightning_zero.planner.saved_activations import SavedActivations

                self._saved = SavedActivations(pl_module).start()
            self._start = time.perf_counter()
            self._cpu_start = time.process_time()
            self._faults_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt

        def _stop_saved(self) -> None:
            # after training_step returned the loss, before zero_grad (its in-place writes) and backward
            if self._saved is not None:
                self.saved_activation_bytes = self._saved.stop()
                self._saved = None

        def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            self._stop_saved()

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            self._stop_saved()  # no zero_grad on this batch (accumulating)
            if self._probing:
                self.states["after_forward"] = state_bytes(trainer)

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if self._probing:
                self.states["before_step"] = state_bytes(trainer)
                self.live_bytes = live_tensor_bytes()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            elapsed = time.perf_counter() - self._start
            cpu = time.process_time() - self._cpu_start
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self._faults_start
            if self._probing:
                self.states["after_step"] = state_bytes(trainer)
                return
            if self._role == "profile":
                self._profiler.__exit__(None, None, None)
                table = self._profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
                assert profile_path is not None
                profile_path.write_text(f"one step, {elapsed:.3f} s wall (profiled)\n{table}")
                return
            if self._role != "timed":
                return
            tap.active = False
            self.step_s.append(elapsed)
            self.cpu_s.append(cpu)
            self.minor_faults.append(faults)
            self.sent.append(dict(tap.bytes))
            if extra_step is not None:
                self.extra.append(extra_step(trainer))

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if at_end is not None:
                self.end = at_end(trainer)

        def summary(self) -> dict[str, Any]:
            kinds = ("params", "grads", "optimizer")
            peak = {kind: max((point.get(kind, 0) for point in self.states.values()), default=0) for kind in kinds}
            peak["total"] = max((sum(point.get(k, 0) for k in kinds) for point in self.states.values()), default=0)
            sent_kinds = sorted({kind for step in self.sent for kind in step})
            return {
                "step_s": self.step_s,
                "cpu_s": self.cpu_s,
                "minor_faults": self.minor_faults,
                "sent_bytes_per_step": {k: statistics.median(s.get(k, 0.0) for s in self.sent) for k in sent_kinds}
                if self.sent
                else {},
                "extra": self.extra,
                "state_points": self.states,
                "state_bytes": peak,
                "live_tensor_bytes_before_step": self.live_bytes,
                "saved_activation_bytes": self.saved_activation_bytes,
                "end": self.end,
            }

    return StepProbe()
