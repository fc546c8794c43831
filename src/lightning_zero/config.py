"""The engine's knobs: :class:`ZeroConfig`, the one place their defaults and validation live.

Plain Python (no Hydra, no omegaconf): ``ZeroStrategy`` builds one from its arguments and hands it
whole to :class:`lightning_zero.zero.engine.ZeroEngine`, whose parts read ``config.<knob>`` where
they use it; the planner takes one too. The Hydra schema of the ``strategy`` group
(``lightning_zero.hydra_config.ZeroStrategyConf``) is generated from it.

[Note: policies] ``ZeroConfig`` is flat for its users (``ZeroStrategy``'s keywords, Hydra's
``strategy.*`` keys); inside, its knobs fall into a few small frozen policies, each a view of the
same values (:data:`POLICY_KNOBS`): ``config.layout`` (:class:`LayoutPolicy`, what
``ParallelDims.from_config`` reads), ``config.sharding`` (:class:`ShardingPolicy`),
``config.communication`` (:class:`CommPolicy`), ``config.precision_knobs``
(:class:`PrecisionKnobs`; with Lightning's precision string they make a
``precision.PrecisionPolicy``), ``config.runtime`` (:class:`RuntimePolicy`: monitor, timeouts)
and ``config.checkpointing`` (:class:`CheckpointPolicy`: background saves, object storage). Code below the strategies takes the policy it needs whole, as FSDP2's
``fully_shard`` takes ``MixedPrecisionPolicy`` and ``OffloadPolicy``, instead of one argument per
knob (tests/test_signatures.py keeps every internal function at 10 parameters or fewer).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

from lightning_zero.precision import PrecisionPolicy, check_precision_knobs, precision_policy

COMM_DTYPE_CHOICES = (None, "fp32", "bf16", "int8")  # grad_comm_dtype / param_comm_dtype


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class PolicyView:
    """``config.<name>``: the policy of that name (defined below the class) built from the config's
    knobs ([Note: policies])."""

    def __init__(self, policy: str) -> None:
        self.policy = policy

    def __get__(self, config: Any, owner: type) -> Any:
        if config is None:
            return self
        cached = config.__dict__.get(self.policy)  # a frozen config's policy never changes
        if cached is None:
            policy = globals()[self.policy]
            cached = policy(**{name: getattr(config, name) for name in POLICY_KNOBS[policy]})
            object.__setattr__(config, self.policy, cached)
        return cached


@dataclass(frozen=True)
class ZeroConfig:
    """Every knob of :class:`lightning_zero.ZeroStrategy` that is plain data, with its default.

    ``ZeroStrategy``'s signature, the Hydra schema of the ``strategy`` group
    (``hydra_config.ZeroStrategyConf``, generated from this class) and the planner all read their defaults
    from :data:`ZERO_DEFAULTS`, so each default is written once, here. Construction validates; every
    error names the argument as ``ZeroStrategy(name=value)`` and says what to pass instead. The
    strategy passes the object whole to :class:`~lightning_zero.zero.engine.ZeroEngine`, whose parts
    read ``config.<knob>`` where they use it; nothing below validates or defaults a knob again.

    The ``Attributes`` below are each knob's one documentation: ``ZeroStrategy``'s docstring and the
    table in docs/cli.md are generated from them (:func:`knob_docs`, :func:`knob_table`; checked by
    tests/test_knobs.py).

    Attributes:
        stage: 1 shards fp32 master weights and optimizer state over the dp ranks; 2 also keeps only
            each rank's shard of the reduced gradients (``2 P / dp`` bytes in bf16); 3 also shards the
            parameters, gathering each unit (block) just in time (``16 P / dp`` bytes of model state in
            bf16-mixed). Under stage 3 a model built in ``configure_model`` is created on the meta
            device and materialized one unit at a time, each rank keeping only its shard.
        tensor_parallel_size: ranks per tensor-parallel group (consecutive ranks of one node), or
            ``"auto"`` for devices per node; ``dp = world_size // tensor_parallel_size``.
        sequence_parallel: shard the norm and residual regions of a tensor-parallel ``LlamaLM``
            over the sequence inside the TP group (Korthikanti et al. 2022): each TP rank keeps
            ``T/tp`` tokens of those activations (``tp`` times fewer bytes there); each
            all-reduce of ``B T dim`` becomes a reduce-scatter plus an all-gather of the same
            bytes. Needs ``tensor_parallel_size > 1`` and a sequence length divisible by it.
            See docs/tensor_parallel.md.
        bucket_mb: gradient bucket size in MiB of gradient elements (of the dtype gradients are reduced
            in: fp32 under ``reduce_dtype="fp32"``, else the parameters' compute dtype), the same at
            every stage and in the planner; each full bucket launches one async reduce-scatter.
            ``"auto"``: a quarter of the model's gradient bytes, between 1 and 25 MiB
            (:func:`resolve_bucket_mb`; the default): a small model still has several buckets
            whose reduce-scatters start while backward runs, a large one gets 25 MiB buckets.
        overlap_comm: launch bucket collectives during backward (``False``: only after it ends).
        prefetch_blocks: stage 3: units all-gathered ahead of the one computing (at most
            ``prefetch_blocks + 1`` gathered at once).
        offload_optimizer: keep fp32 master and optimizer-state shards in CPU memory; the optimizer
            steps on the CPU and the updated chunk is copied back to the device.
        defer_grad_reduce: stages 2 and 3 with accumulation: keep full gradients over micro batches
            and reduce once at the last (stage-1 gradient memory, one reduce-scatter per step; at
            stage 3 the parameters stay sharded), as FSDP2's ``set_requires_gradient_sync(False)``.
            Under ``bf16-true`` this is what equals ddp bit for bit (docs/precision.md). Stage 1
            always defers ([Note: deferred gradient reduction] in ``zero/bucketing.py``).
        exact_grad_norm: gradient clipping by norm computes each parameter's norm over its whole
            gradient on one rank and stacks the norms in torch's order, so the clip coefficient is
            ``clip_grad_norm_``'s under ddp bit for bit; the runs of parameters cut between ranks'
            chunks travel to one rank once per clip (up to ``(n-1)/n`` of their gradient bytes).
            Muon's matrices always do (they go to their owners anyway): [Note: exact gradient
            norm] in ``zero/owner_exchange.py``, docs/optimizers.md.
        max_buckets_in_flight: gradient reduce-scatters in flight at once, every stage (a launch
            first waits for the oldest); stage 2/3: the pool of full-size bucket buffers holds one
            more (those in flight and the one filling: gradient memory is the shard plus
            ``max_buckets_in_flight + 1`` buckets), kept between backwards and freed when fit ends.
        monitor: the run's monitor (``runtime/monitor.py``: measured vs predicted bytes, bytes sent,
            overlap, tokens/s, MFU, per optimizer step, no device sync); the Trainer door attaches
            :class:`~lightning_zero.ZeroMonitor`, the Fabric door logs through ``fabric.log_dict``
            once ``strategy.report_to(fabric)`` was called. See docs/fabric.md.
        collective_timeout: seconds any wait of the engine on a collective (gradient
            reduce-scatter, parameter all-gather, clipping norm) may take before it raises an error
            saying what this rank waited on and how far its backward got ("5/12 params ready in
            bucket 3"), instead of hanging for the process group's ``timeout`` (30 minutes by
            default). ``None`` leaves only the process group's timeout. On NCCL it becomes the
            watchdog timeout of every process group the engine uses, the default group included
            ([Note: collective timeout on NCCL] in ``zero/waits.py``). See docs/troubleshooting.md.
        overlap_param_gather: stages 1-2: the parameter all-gather after the optimizer step (one
            per bucket, ``(dp-1)/dp`` of the parameter bytes per rank) stays in flight and each
            bucket is waited for in the forward pre-hook of the modules owning its parameters, so
            it overlaps the next forward (Megatron-Core's ``overlap_param_gather``). ``False``:
            every all-gather is waited for inside the optimizer step. Evaluation, checkpoints and the
            end of fit wait for every pending gather first.
        grad_comm_dtype: what the gradient reduce-scatter sends (ZeRO++ qgZ): ``None`` (the
            gradient buffer's own dtype, no compression), ``"fp32"``, ``"bf16"`` (2 bytes per
            element) or ``"int8"`` (1 byte per element + one fp32 scale per 256 elements); a
            compressed reduce-scatter is an all-to-all whose chunks are summed in fp32 on arrival.
            See docs/compression.md.
        param_comm_dtype: what the parameter all-gathers send (ZeRO++ qwZ; stage 3's per-unit
            gathers, stages 1-2's gather after the step), same values as ``grad_comm_dtype``.
            With a lossy choice every rank (the owner too) computes with the dequantized values
            while the fp32 masters stay exact (stages 1-2 in fp32 then keep a separate fp32 master
            chunk: ``4 / dp`` bytes per parameter).
        shard_size: dp ranks ZeRO shards over (hybrid sharding, docs/topology.md): ``None`` (default)
            shards over all dp ranks; an int ``N`` shards over groups of ``N`` consecutive dp ranks
            and replicates across the ``dp // N`` groups (gradients reduce-scatter inside a group, then
            each chunk is all-reduced across groups; stage-3 all-gathers stay inside a group);
            ``"node"`` is the dp ranks of one node (``devices_per_node // tensor_parallel_size``).
            Model-state memory follows the ZeRO formulas with ``shard_size`` in place of dp. Must
            divide dp, and a group must fit inside one node or be whole nodes (checked at setup).
        hierarchical_reduce: when a shard group spans nodes, reduce gradients in two hops: a
            reduce-scatter inside each node, then a reduce-scatter of the node's slice across nodes,
            so each gradient byte crosses the slow link once (``(nodes-1)/nodes * N/local`` bytes
            per rank instead of ``(dp-1)/dp * N``). Ignored when the shard group fits in one node.
        reduce_dtype: the dtype gradients are accumulated in over micro batches and reduced
            (reduce-scattered) in. ``"compute"`` (default; ``"bf16"`` is accepted as its name
            under bf16-mixed): the compute dtype, i.e. bf16 gradients under bf16-mixed, the ZeRO
            paper's ``2 + 2 + 12`` bytes per parameter and ``2 (dp-1)/dp`` bytes sent per
            gradient element. ``"fp32"``: fp32 bucket buffers and gradient shards, each bf16
            micro-batch gradient added into them in fp32 and the reduce-scatter run in fp32
            (Megatron's ``grad_reduce_in_fp32``, FSDP2's ``reduce_dtype=torch.float32``): 2 more
            bytes per gradient element held (``P`` at stage 1, ``P / dp`` at stages 2-3) and twice
            the gradient bytes sent, for sums that do not drift over long accumulation. Under
            ``precision="32-true"`` both are fp32.
        master_weights: under ``precision="bf16-true"`` / ``"16-true"``: ``"auto"`` (default) steps
            the half-precision parameters themselves, with optimizer state in the same dtype, as
            Lightning's ddp holds them (``2 + 2 + 4`` bytes per parameter for AdamW before
            sharding; stage 3 holds ``8 P / dp``); ``"fp32"`` keeps fp32 master weights and fp32
            optimizer state in the shards under the same half-precision compute (``2 + 2 + 12``,
            the bf16-mixed bytes), for fine-tunes whose bf16 updates stall. No effect under
            ``32-true`` and the ``-mixed`` precisions (fp32 masters already). See docs/precision.md.
        mixed_params: under ``precision="16-mixed"`` / ``"bf16-mixed"``, what the engine holds
            between steps. ``"fp32"``: Lightning's semantics, as ddp holds them: fp32 parameters and
            gradients, the forward under autocast, fp32 gradients reduced, the parameter chunk its
            own master (``4 + 4 + 8`` bytes per parameter for AdamW before sharding; twice the
            gradient and parameter bytes sent); under 16-mixed the loss scale takes ddp's steps.
            ``"half"``: DeepSpeed's semantics: half-precision parameters and gradients at every
            stage, fp32 masters and optimizer state only in the shards (``2 + 2 + 12``; the same
            ``16 P / dp`` at stage 3, less at stages 1-2). ``"auto"`` (default): ``"fp32"`` under
            16-mixed (ddp's numbers), ``"half"`` under bf16-mixed. No effect under ``32-true`` and
            the ``-true`` precisions. See docs/precision.md.
        async_checkpoint: a checkpoint save holds training only while each rank copies the tensors
            it writes to host memory (one copy of this rank's checkpoint bytes, allocated by a thread
            after the first optimizer step and kept for every save); writing, hashing and the atomic publish run in a background thread over
            a gloo process group of their own. The next save, the end of fit, a requeue and a load
            wait for it; a failure abandons it (the previous checkpoint stays the newest). The files
            hold the same bytes as a synchronous save's. See docs/checkpoints.md.
        storage_options: keywords for the fsspec file system of a checkpoint path that is a URL
            (``s3://``, ``gs://``, ``memory://``): ``ModelCheckpoint(dirpath=...)``, ``ckpt_path=``,
            ``trainer.save_checkpoint``, ``fabric.save``/``load``. ``None``: the file system's
            defaults, credentials from the environment as it reads them (s3fs: ``AWS_*``,
            ``~/.aws``, instance roles). Local paths ignore it. See docs/checkpoints.md.
        upload_threads: objects each rank writes to object storage at once (its shards split into
            this many objects of about equal bytes, each uploaded in 8 MiB parts); ranged reads on
            load use as many threads. Local paths ignore it.
        upload_stall_s: seconds an upload to (or a ranged read from) object storage may go without
            finishing a part before the save fails with an error naming the rank, the object and
            the bytes uploaded so far (the previous checkpoint stays the newest). Local paths ignore it.
        cp: context-parallel size: ranks that each hold a contiguous slice of every sequence (the
            same samples), so a rank keeps ``T / cp`` tokens of activations. ``world_size = dp * cp *
            tp`` (cp between dp and tp in the rank order); ZeRO shards dense parameters, gradients
            and optimizer state over the ``dp * cp`` ranks of one tp rank and averages dense
            gradients over them. Needs a model that splits sequences over cp (its
            ``check_parallel_dims``). Under Fabric the loop cuts each whole batch with the
            strategy's ``context_slice``. See docs/context_parallel.md.
        ep: expert-parallel size: ``ep`` consecutive ranks of the ``dp * cp`` group split a mixture
            of experts' experts (each holds ``num_experts / ep``; tokens reach their experts by
            all-to-all). Must divide ``dp * cp``; expert parameters are sharded (stages 1-3) over the
            ``dp * cp / ep`` ranks holding the same experts. Needs a model with expert layers (its
            ``check_parallel_dims``). See docs/topology.md.
        pp: pipeline-parallel size: ranks that each hold a run of consecutive decoder blocks (a
            stage; the embeddings on the first, the norm, head and loss on the last) and pass
            activations forward and gradients back point to point. ``world_size = pp * dp * cp *
            tp`` with pp outermost (stages cross nodes, TP stays inside one); every other group
            lives inside one pp rank's ``world_size / pp`` ranks. See docs/pipeline.md.
        pp_schedule: the pipeline schedule, one of torch's (``pp/layout.py`` ``SCHEDULES``):
            ``"gpipe"`` (every micro-batch's forward, then every backward: all ``m`` in flight),
            ``"1f1b"`` (at most ``pp`` micro-batches in flight, on the first stage),
            ``"interleaved_1f1b"`` and ``"interleaved_zb"`` (``pp_virtual_stages`` stages per rank,
            a smaller bubble), ``"zbv"`` (two stages per rank in a V, backward split into input and
            weight gradients). Its bubble and in-flight micro-batches: ``lightning-zero plan``.
        pp_virtual_stages: stages each pp rank runs under the interleaved schedules (``>= 2``;
            ``num_stages = pp * pp_virtual_stages``); 1 for ``gpipe`` and ``1f1b``; ``zbv`` runs 2.
        pp_layers: decoder blocks per stage, by hand (one positive count per stage, summing to the
            model's blocks), or ``None``: the planner's split, even across the middle stages.
        pp_microbatches: micro-batches one step's batch is cut into (each a forward and a backward
            through every stage; more of them shrink the bubble, ``(pp-1)/(m+pp-1)`` under 1F1B).
            ``None``: one per stage (``pp * stages per rank``), the fewest every schedule accepts.
    """

    stage: int = 2
    tensor_parallel_size: Union[int, str] = 1
    sequence_parallel: bool = False
    bucket_mb: Union[float, str] = "auto"
    overlap_comm: bool = True
    prefetch_blocks: int = 1
    offload_optimizer: bool = False
    defer_grad_reduce: bool = False
    exact_grad_norm: bool = False
    max_buckets_in_flight: int = 2
    monitor: bool = True
    collective_timeout: Optional[float] = 300.0
    overlap_param_gather: bool = True
    grad_comm_dtype: Optional[str] = None
    param_comm_dtype: Optional[str] = None
    shard_size: Optional[Union[int, str]] = None
    hierarchical_reduce: bool = False
    reduce_dtype: str = "compute"
    master_weights: str = "auto"
    mixed_params: str = "auto"
    async_checkpoint: bool = False
    storage_options: Optional[dict] = None
    upload_threads: int = 8
    upload_stall_s: float = 60.0
    cp: int = 1
    ep: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    pp_layers: Optional[list[int]] = None
    pp_microbatches: Optional[int] = None

    def __post_init__(self) -> None:
        def fail(name: str, fix: str) -> None:
            raise ValueError(f"ZeroStrategy({name}={getattr(self, name)!r}): {fix}")

        if not _is_int(self.stage) or self.stage not in (1, 2, 3):
            fail("stage", "stage must be 1, 2 or 3.")
        tp = self.tensor_parallel_size
        if not (tp == "auto" or (_is_int(tp) and tp >= 1)):
            fail("tensor_parallel_size", "give a positive int or 'auto' (= devices per node).")
        bucket = self.bucket_mb
        if bucket != "auto" and (isinstance(bucket, bool) or not isinstance(bucket, (int, float)) or not bucket > 0):
            fail(
                "bucket_mb",
                "the gradient bucket size must be a number of MiB > 0 or 'auto' (25 is a good start; larger"
                " buckets mean fewer, bigger reduce-scatters).",
            )
        if not _is_int(self.prefetch_blocks) or self.prefetch_blocks < 0:
            fail("prefetch_blocks", "must be an int >= 0 (0 gathers each unit only when it runs).")
        if not _is_int(self.max_buckets_in_flight) or self.max_buckets_in_flight < 1:
            fail("max_buckets_in_flight", "must be an int >= 1.")
        if not _is_int(self.cp) or self.cp < 1:
            fail("cp", "the context-parallel size must be an int >= 1 (1: every rank holds whole sequences).")
        if not _is_int(self.ep) or self.ep < 1:
            fail("ep", "the expert-parallel size must be an int >= 1 (1: every rank holds every expert).")
        self._check_pp(fail)
        if self.ep > 1 and (self.shard_size is not None or self.hierarchical_reduce):
            raise ValueError(
                f"ZeroStrategy(ep={self.ep}, shard_size={self.shard_size!r}, hierarchical_reduce="
                f"{self.hierarchical_reduce}): hybrid sharding of expert parameters is not supported yet;"
                " with ep > 1 use shard_size=None and hierarchical_reduce=False (or ep=1)."
            )
        for name in (
            "sequence_parallel",
            "overlap_comm",
            "offload_optimizer",
            "defer_grad_reduce",
            "exact_grad_norm",
            "monitor",
            "overlap_param_gather",
            "async_checkpoint",
        ):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be True or False.")
        if self.sequence_parallel and tp == 1:
            raise ValueError(
                "ZeroStrategy(sequence_parallel=True, tensor_parallel_size=1): sequence parallelism shards"
                " activations inside the tensor-parallel group; set tensor_parallel_size > 1 (or 'auto')"
                " or sequence_parallel=False."
            )
        timeout = self.collective_timeout
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
        ):
            fail(
                "collective_timeout",
                "give a number of seconds > 0 (default 300) or None for the process group's own timeout.",
            )
        for name in ("grad_comm_dtype", "param_comm_dtype"):
            if getattr(self, name) not in COMM_DTYPE_CHOICES:
                fail(
                    name,
                    "give None (no compression: send the buffer's own dtype), 'fp32', 'bf16' or 'int8'"
                    " (block-wise int8 with one fp32 scale per block); see docs/compression.md.",
                )
        shard = self.shard_size
        if not (shard is None or shard == "node" or (_is_int(shard) and shard >= 1)):
            fail(
                "shard_size",
                "give None (shard over all dp ranks), 'node' (the dp ranks of one node) or a positive int"
                " that divides dp.",
            )
        if not isinstance(self.hierarchical_reduce, bool):
            fail("hierarchical_reduce", "must be True or False.")
        if self.reduce_dtype not in REDUCE_DTYPES:
            fail(
                "reduce_dtype",
                'give "compute" (gradients in the compute dtype; "bf16" is the same under bf16-mixed)'
                ' or "fp32" (accumulate and reduce gradients in fp32).',
            )
        check_precision_knobs(master_weights=self.master_weights, mixed_params=self.mixed_params)
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            fail(
                "storage_options",
                'give a dict of fsspec keywords (e.g. {"client_kwargs": {"endpoint_url": ...}}) or None.',
            )
        if not _is_int(self.upload_threads) or self.upload_threads < 1:
            fail("upload_threads", "give an int >= 1 (objects each rank uploads at once).")
        stall = self.upload_stall_s
        if isinstance(stall, bool) or not isinstance(stall, (int, float)) or not stall > 0:
            fail("upload_stall_s", "give a number of seconds > 0 (default 60).")
        object.__setattr__(self, "upload_stall_s", float(stall))
        if bucket != "auto":
            object.__setattr__(self, "bucket_mb", float(bucket))
        if timeout is not None:
            object.__setattr__(self, "collective_timeout", float(timeout))

    def _check_pp(self, fail: Any) -> None:
        """The pipeline knobs' types; the split against the model is ``pp/layout.py``'s
        ``PipelineLayout`` (it needs the model's block count)."""
        if not _is_int(self.pp) or self.pp < 1:
            fail("pp", "the pipeline-parallel size must be an int >= 1 (1: every rank holds every block).")
        if self.pp_schedule not in PP_SCHEDULES:
            fail("pp_schedule", f"pick one of {PP_SCHEDULES} (docs/pipeline.md).")
        if not _is_int(self.pp_virtual_stages) or self.pp_virtual_stages < 1:
            fail("pp_virtual_stages", "give an int >= 1 (stages per pp rank; >= 2 for the interleaved schedules).")
        layers = self.pp_layers
        if layers is not None and (isinstance(layers, (str, bytes)) or not all(_is_int(n) and n >= 1 for n in layers)):
            fail("pp_layers", "give None (the planner's split) or a list of positive block counts, one per stage.")
        if layers is not None:
            object.__setattr__(self, "pp_layers", [int(n) for n in layers])
        m = self.pp_microbatches
        if m is not None and (not _is_int(m) or m < 1):
            fail("pp_microbatches", "give None (one per stage) or an int >= 1.")

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    layout = PolicyView("LayoutPolicy")  # what ParallelDims.from_config reads (it adds the cluster)
    sharding = PolicyView("ShardingPolicy")
    communication = PolicyView("CommPolicy")
    precision_knobs = PolicyView("PrecisionKnobs")  # precision_policy(name) adds Lightning's precision
    runtime = PolicyView("RuntimePolicy")
    checkpointing = PolicyView("CheckpointPolicy")

    def precision_policy(self, precision: Any) -> "PrecisionPolicy":
        """Where each byte lives under Lightning's ``precision`` with these knobs (``precision.py``)."""
        return precision_policy(precision, self.master_weights, self.mixed_params)


def _policy(name: str, doc: str, knobs: tuple[str, ...]) -> type:
    """A frozen dataclass ``name`` holding ``knobs``, each with its ``ZeroConfig`` annotation: the
    policies ([Note: policies]) declare no knob again; its default and documentation stay on
    ``ZeroConfig``, and ``ZeroConfig(...).<policy>`` builds one."""
    hints = ZeroConfig.__annotations__
    policy = dataclasses.make_dataclass(name, [(knob, hints[knob]) for knob in knobs], frozen=True)
    policy.__doc__, policy.__module__ = doc, __name__
    return policy


LayoutPolicy = _policy(
    "LayoutPolicy",
    "The parallel sizes a config asks for: what ``comm.mesh.ParallelDims`` is built from.",
    ("tensor_parallel_size", "sequence_parallel", "cp", "ep", "shard_size", "hierarchical_reduce", "pp",
     "pp_schedule", "pp_virtual_stages", "pp_layers", "pp_microbatches"),
)  # fmt: skip
ShardingPolicy = _policy(
    "ShardingPolicy",
    "What ZeRO keeps on each rank: the stage, when gradients are reduced, stage 3's prefetch, where"
    " the optimizer state lives, where clipping's per-parameter norms are computed.",
    ("stage", "defer_grad_reduce", "prefetch_blocks", "offload_optimizer", "exact_grad_norm"),
)
CommPolicy = _policy(
    "CommPolicy",
    "How gradients and parameters travel: bucket size, overlap, what goes on the wire.",
    ("bucket_mb", "overlap_comm", "max_buckets_in_flight", "overlap_param_gather", "grad_comm_dtype",
     "param_comm_dtype"),
)  # fmt: skip
PrecisionKnobs = _policy(
    "PrecisionKnobs",
    "The precision knobs: the gradient reduce dtype, masters under ``-true``, parameters under ``-mixed``.",
    ("reduce_dtype", "master_weights", "mixed_params"),
)
RuntimePolicy = _policy(
    "RuntimePolicy",
    "What the run around the engine does: the monitor and the wait limit on collectives.",
    ("monitor", "collective_timeout"),
)
CheckpointPolicy = _policy(
    "CheckpointPolicy",
    "How checkpoints are written: in the background or not, and to object storage (file system"
    " keywords, uploads at once, the stall limit).",
    ("async_checkpoint", "storage_options", "upload_threads", "upload_stall_s"),
)
POLICIES = (LayoutPolicy, ShardingPolicy, CommPolicy, PrecisionKnobs, RuntimePolicy, CheckpointPolicy)
POLICY_KNOBS = {policy: tuple(f.name for f in dataclasses.fields(policy)) for policy in POLICIES}
"""``{policy class: the ZeroConfig knobs it holds}``; every knob is in exactly one (tests/test_config.py)."""


AUTO_BUCKET_MB = (1.0, 25.0)  # bounds of bucket_mb="auto", MiB
REDUCE_DTYPES = ("compute", "bf16", "fp32")  # values of ZeroConfig.reduce_dtype
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv")  # pp/layout.py SCHEDULES


def reduce_in_fp32(reduce_dtype: str) -> bool:
    """Whether ``ZeroConfig.reduce_dtype`` asks for fp32 gradient buffers and reductions (under
    bf16-mixed; under 32-true everything is fp32 anyway)."""
    return reduce_dtype == "fp32"


def resolve_bucket_mb(bucket_mb: Union[float, str], grad_bytes: float) -> float:
    """The bucket size in MiB for ``bucket_mb``; ``"auto"`` is a quarter of ``grad_bytes`` (the
    gradients one rank reduces per backward), clamped to ``AUTO_BUCKET_MB``. The engine and the
    planner both size buckets through this function."""
    if bucket_mb != "auto":
        return float(bucket_mb)
    low, high = AUTO_BUCKET_MB
    return min(high, max(low, grad_bytes / 4 / 2**20))


ZERO_DEFAULTS = ZeroConfig()
"""The defaults of every :class:`ZeroConfig` knob (what ``ZeroStrategy()`` uses)."""

TOPOLOGY_KNOBS = ("shard_size", "hierarchical_reduce", "grad_comm_dtype", "param_comm_dtype")
"""The knobs that shape how the dp ranks shard, reduce and compress (docs/topology.md); the
planner's report and search vary them."""


def topology_defaults() -> dict[str, Any]:
    """``{knob: default}`` for :data:`TOPOLOGY_KNOBS`, from :data:`ZERO_DEFAULTS`: ZeRO over every
    dp rank, a one-hop reduce, the native wire format."""
    return {name: getattr(ZERO_DEFAULTS, name) for name in TOPOLOGY_KNOBS}


def knob_docs() -> dict[str, str]:
    """``{knob: its documentation}`` from the ``Attributes:`` section of :class:`ZeroConfig`'s
    docstring, the one place each knob is described; every text unwrapped to one line."""
    docs: dict[str, str] = {}
    lines = inspect.cleandoc(ZeroConfig.__doc__ or "").splitlines()
    start = lines.index("Attributes:") + 1
    name = None
    for line in lines[start:]:
        if line.startswith("    ") and not line.startswith("     ") and ":" in line:
            name, _, text = line.strip().partition(": ")
            docs[name] = text.strip()
        elif line.startswith("        ") and name is not None:
            docs[name] += " " + line.strip()
        elif line.strip():
            break
    return docs


def knob_views(cls: type) -> type:
    """Class decorator for a holder of a ``zero_config`` (``ZeroStrategy``): ``obj.<knob>`` becomes a
    read-only view of ``obj.zero_config.<knob>``, and the class docstring gets a ``Knobs`` section
    generated from :func:`knob_docs`."""

    def view(name: str) -> property:
        def read(self: Any) -> Any:
            return getattr(self.zero_config, name)

        return property(
            read, doc=f"``zero_config.{name}`` (read-only; documented on :class:`~lightning_zero.config.ZeroConfig`)."
        )

    for name in ZERO_DEFAULTS.as_dict():
        setattr(cls, name, view(name))
    cls.__doc__ = (
        (cls.__doc__ or "").rstrip()
        + "\n\n    Knobs (generated from ZeroConfig):\n"
        + "".join(f"        {name}: {text}\n" for name, text in knob_docs().items())
    )
    return cls


def _markdown(text: str) -> str:
    """reST inline markup of the knob docs as Markdown: ``x`` and :role:`x` become `x`."""
    text = re.sub(r":\w+:`~?([^`]+)`", lambda m: "`" + m.group(1).rsplit(".", 1)[-1] + "`", text)
    return text.replace("``", "`").replace("|", "\\|")


def _yaml_default(name: str) -> str:
    if name == "stage":
        return "1 / 2 / 3"
    value = getattr(ZERO_DEFAULTS, name)
    if value is None:
        return "`null`"
    return f"`{str(value).lower() if isinstance(value, bool) else value}`"


def knob_table() -> str:
    """The ``key (zero*) | default | meaning`` table of docs/cli.md, generated from
    :func:`knob_docs` and :data:`ZERO_DEFAULTS` (``python -m lightning_zero.config`` prints it)."""
    rows = ["| key (zero*) | default | meaning |", "| --- | --- | --- |"]
    for name, text in knob_docs().items():
        rows.append(f"| `{name}` | {_yaml_default(name)} | {_markdown(text)} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(knob_table())
