"""What the ZeRO formulas leave out of a rank's optimizer-state bytes, and what stage 3 holds
gathered by its own rule (shared by the byte tests)."""

from __future__ import annotations


def state_beyond_formula(engine, moments_bytes: int = 8, step_bytes: int = 4) -> int:
    """Bytes of optimizer state a rank holds beyond ``model_state_bytes``'s padded formula.

    The optimizer steps one view per parameter's owned run of a master chunk ([Note: parameters
    nobody used] in zero/reducer.py): Adam's moments (``moments_bytes`` per element) cover the runs
    but not the chunks' padding, and each run has its own scalar ``step`` (``step_bytes``).
    """
    runs = list(engine.owned_ranges())
    chunk_numel = sum(master.numel() for group in engine.groups for master in group.masters)
    padding_here = chunk_numel - sum(run.chunk_hi - run.chunk_lo for run in runs)
    return step_bytes * len(runs) - moments_bytes * padding_here


def bytes_record(engine) -> dict:
    """What a test needs to hold an engine's measured model-state bytes against the ledger's: the
    measurement, the monitor's prediction (the ledger's rule, unpadded), the padding, the state
    beyond the formula (:func:`state_beyond_formula`, moments in the optimizer state's dtype) and
    the dtypes of the masters and the optimizer state."""
    from lightning_zero.trainer.monitor import predicted_bytes

    optimizer = engine.optimizers[0].optimizer
    state = [value for values in optimizer.state.values() for key, value in values.items() if key != "step"]
    return {
        "measured": engine.measured_bytes(),
        "predicted": predicted_bytes(engine, optimizer),
        "padding": engine.padding_numel(),
        "num_params": engine.num_params(),
        "beyond": state_beyond_formula(engine, moments_bytes=2 * engine.master_dtype.itemsize),
        "state_dtypes": sorted({str(value.dtype) for value in state}),
        "master_dtypes": sorted({str(m.dtype) for group in engine.groups for m in group.masters}),
        "stage": engine.stage,
        "dp": engine.dp_size,
    }


def walked_high_water(runtime) -> int:
    """The most non-root elements the engine's rule says a rank holds gathered at once, walking
    the recorded training schedule ([Note: gathered working set] in zero/stage3/schedule.py)."""
    from lightning_zero.zero.stage3.gather_order import gathered_high_water

    schedule = runtime.schedules["train"]
    numel = {unit.index: unit.numel for unit in runtime.units[:-1]}
    return gathered_high_water(schedule.order, schedule.in_backward, numel, runtime.config.prefetch_blocks)


def llama_step(model, opt, engine, gen, rank: int, world: int) -> None:
    """One optimizer step of a tiny Llama (vocabulary 64) under ``engine`` on rank ``rank``'s two
    samples of a ``(world, 2, 9)`` token batch drawn from ``gen`` (stage 3 marks the step first)."""
    import torch

    batch = torch.randint(0, 64, (world, 2, 9), generator=gen)[rank]
    opt.zero_grad()
    if engine.stage3 is not None:
        engine.stage3.begin_step()
    model.loss_fn(model(batch[:, :-1]), batch[:, 1:]).backward()
    opt.step()
