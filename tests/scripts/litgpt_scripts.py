"""LitGPT's own scripts, unchanged, on 2 CPU processes: under Fabric's ddp and under ZeroFabricStrategy.

Usage: python tests/scripts/litgpt_scripts.py OUT_DIR CASE [CASE ...]
Launched torchrun-style by tests/test_litgpt_scripts.py; one launch runs several cases in turn, each
through ``lightning_zero.fabric.litgpt.run`` (LitGPT's CLI with every ``L.Fabric`` built on the
case's strategy). CASE = ``<script>-<strategy>-<precision>[-resume]``: script ``lora``, ``adapter``,
``full``, ``pretrain``; strategy ``ddp``, ``zero1``, ``zero2``, ``zero3``, ``zero2defer``, ``zero3defer``
(``defer_grad_reduce=True``), ``zero1cp2`` (stage 1 with ``--cp 2``, on 4 processes: dp 2 as ddp's), ``zero1tp2``
(``--tp 2``, on 4 processes: dp 2), ``zero1tp2cp2`` (both, on 4 processes: dp 1), ``ddp1`` (Fabric's DDP
on one process: the reference of dp 1); precision ``32`` or ``bf16``
(``32-true`` / ``bf16-true``). ``-resume`` runs ``full`` / ``pretrain`` again with ``--resume`` from the
step-2 checkpoint of the same case's first run (which ran 4 steps), into a directory of its own.
``-nodropout`` runs ``lora`` with ``--lora_dropout 0`` (under cp each rank draws dropout for its slice
of the sequence, other numbers than ddp's draw for the whole: compared without it). ``-generate`` runs ``lora`` with LitGPT's rank-0 ``generate_example`` on (``--eval.interval 2``, one
epoch: after the validations at steps 2 and 4 and when the epoch ends) and records what it generated.

What the runs share, made once by rank 0 (no network): a byte-level BPE ``tokenizer.json`` trained with
the ``tokenizers`` library on the corpus below, a tiny LitGPT config, base checkpoints holding the base
model only (no LoRA or adapter tensors, as every real checkpoint: the scripts build those under
``init_module(empty_init=True)`` and load the checkpoint with ``strict=False``), an instruction dataset
for ``litgpt.data.JSON`` and text files for ``litgpt.data.TextFiles``. Each case records the seconds it
took; the test reads LitGPT's own CSV logs and saved files.

The reference (``ddp``) is Fabric's DDP with the model built eagerly (``empty_init`` ignored): under
Fabric's own ``empty_init=True`` the tensors the checkpoint does not hold stay uninitialized memory,
where ours take the values eager construction gives ([Note: deferred init] in zero/stage3/deferred.py).

``reseed-<strategy>-32``: LitGPT's GPT built under ``fabric.init_module(empty_init=True)``, a new seed,
then LitGPT's ``reset_parameters(model)`` (pretrain's order with a reseed between), two training steps
with dropout; records the weights after setup, the losses, and a draw from the stream afterwards.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch  # noqa: E402

torch.set_num_threads(1)
# pretrain's torch.compile runs eager (an inductor build on CPU takes minutes), for ddp and us alike: as
# TORCH_COMPILE_DISABLE=1 does (read when dynamo's config is first imported, which a fork server did)
os.environ["TORCH_COMPILE_DISABLE"] = "1"
torch._dynamo.config.disable = True

from lightning_zero.fabric.litgpt import run  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "2"))
CONFIG = dict(name="tiny-lz", block_size=32, vocab_size=120, padded_vocab_size=128, n_layer=2, n_head=4, n_embd=32,
              n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
              mlp_class_name="LLaMAMLP", intermediate_size=64)  # fmt: skip
WORDS = ("the model learns to shard every optimizer state across the ranks while the loss falls and the"
         " gradients meet in buckets before each step of training a tiny llama on plain text").split()  # fmt: skip
SCRIPTS = {"lora": "finetune_lora", "adapter": "finetune_adapter", "full": "finetune_full", "pretrain": "pretrain"}


def sentence(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n))


def prepare(root: Path) -> None:
    """The shared inputs (rank 0, once); the other ranks wait for ``ready``."""
    ready = root / "ready"
    if RANK != 0:
        while not ready.exists():
            if (root / "failed").exists():
                raise RuntimeError("rank 0 failed to prepare the inputs")
            time.sleep(0.1)
        return
    if ready.exists():
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    try:
        _prepare(root, Tokenizer, decoders, models, pre_tokenizers, trainers)
    except BaseException:
        (root / "failed").write_text(traceback.format_exc())
        raise
    ready.write_text("ok")


def _prepare(root: Path, Tokenizer, decoders, models, pre_tokenizers, trainers) -> None:
    from litgpt.model import GPT
    from litgpt.model import Config as BaseConfig

    corpus = [sentence(i, 12 + i % 9) for i in range(64)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=CONFIG["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(corpus, trainer)
    assert tokenizer.get_vocab_size() <= CONFIG["padded_vocab_size"], tokenizer.get_vocab_size()
    tokenizer_config = {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}

    import yaml

    torch.manual_seed(7)
    plain = GPT(BaseConfig(**CONFIG)).state_dict()
    for name in ("base", "lora", "adapter"):  # the adapter's directory: its model_config.yaml sets ADAPTER
        directory = root / "checkpoints" / name
        directory.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
        (directory / "model_config.yaml").write_text(
            yaml.safe_dump({**CONFIG, **(ADAPTER if name == "adapter" else {})})
        )
        # the base model only: the LoRA and adapter tensors come from the model's own initialization
        torch.save(dict(plain), directory / "lit_model.pth")
    rows = [
        {"instruction": sentence(i, 4 + i % 3), "input": "", "output": sentence(i + 5, 6 + i % 4)} for i in range(40)
    ]
    (root / "instructions.json").write_text(json.dumps(rows))
    texts = root / "texts"
    texts.mkdir(exist_ok=True)
    for index in range(3):
        (texts / f"part{index}.txt").write_text("\n".join(corpus[index::3] * 6))
    write_token_chunks(texts, root / "checkpoints" / "base", block_size=PRETRAIN_SEQ + 1)


def write_token_chunks(texts: Path, tokenizer_dir: Path, block_size: int) -> None:
    """What ``TextFiles.prepare_data`` writes (``texts/train``, ``texts/val``: the first file is the
    validation split), tokenized as it tokenizes, with litdata's own writer in this process: its
    ``optimize`` spawns worker processes, minutes on a loaded 2-core machine. TextFiles finds both
    directories and reads them with litdata's ``StreamingDataset`` as usual."""
    from litdata.streaming import TokensLoader
    from litdata.streaming.writer import BinaryWriter
    from litgpt.tokenizer import Tokenizer

    tokenizer = Tokenizer(tokenizer_dir)
    val, *train = sorted(texts.glob("*.txt"))
    for split, files in (("train", train), ("val", [val])):
        writer = BinaryWriter(str(texts / split), chunk_bytes="50MB", item_loader=TokensLoader(block_size=block_size))
        for index, path in enumerate(files):
            writer.add_item(index, tokenizer.encode(path.read_text().strip(), bos=True, eos=False))
        writer.done()
        writer._merge_no_wait()  # merge() waits for one index per rank of the launch (WORLD_SIZE)


LORA = dict(lora_r=4, lora_alpha=8, lora_query=True, lora_key=False, lora_value=True)
ADAPTER = dict(adapter_prompt_length=4, adapter_start_layer=0)
STEPS = 4
PRETRAIN_SEQ = 16


def command(root: Path, script: str, strategy: str, precision: str, out: Path, resume: bool,
            generate: bool = False, model_parallel: int = 1) -> list[str]:  # fmt: skip
    """LitGPT's command line for a case. ``model_parallel``: the ranks of one dp index (cp x tp):
    LitGPT counts every process as a data-parallel rank, so the global batch and pretrain's token
    budget grow by it to keep ddp's step (docs/fabric.md, LitGPT)."""
    devices, batch = WORLD, 8 * model_parallel
    common = ["--out_dir", str(out), "--precision", {"32": "32-true", "bf16": "bf16-true"}[precision],
              "--devices", str(devices), "--logger_name", "csv", "--train.log_interval", "1",
              "--train.save_interval", "2", "--train.lr_warmup_steps", "1"]  # fmt: skip
    if script == "pretrain":
        return ["pretrain", CONFIG["name"], "--model_config", json.dumps(CONFIG),
                "--tokenizer_dir", str(root / "checkpoints/base"), "--data", "TextFiles",
                "--data.train_data_path", str(root / "texts"), "--data.num_workers", "0",
                "--train.micro_batch_size", "2", "--train.global_batch_size", str(batch), "--train.max_seq_length", str(PRETRAIN_SEQ),
                "--train.max_tokens", str(STEPS * batch * PRETRAIN_SEQ), "--train.max_norm", "1.0",
                "--eval.interval", "1000", "--eval.max_iters", "2", "--eval.final_validation", "false",
                *common, *(["--resume", str(resume_path(out, script))] if resume else [])]  # fmt: skip
    checkpoint = {"lora": "lora", "adapter": "adapter", "full": "base"}[script]
    args = [SCRIPTS[script], str(root / "checkpoints" / checkpoint), "--data", "JSON",
            "--data.json_path", str(root / "instructions.json"), "--data.val_split_fraction", "0.2",
            "--data.num_workers", "0", "--train.micro_batch_size", "2", "--train.global_batch_size", str(batch),
            "--train.max_steps", str(STEPS), "--train.epochs", "100", "--train.max_seq_length", "32",
            "--eval.interval", "1000", "--eval.max_iters", "2", "--eval.max_new_tokens", "4",
            "--eval.final_validation", "false", *common]  # fmt: skip
    if script == "lora":
        args += [item for key, value in LORA.items() for item in (f"--{key}", str(value).lower())]
    if generate:  # LitGPT's rank-0 generate_example after the validation at step 2 and when the epoch ends
        args += [
            "--eval.interval",
            "2",
            "--train.epochs",
            "1",
            "--train.max_steps",
            "100",
            "--data.prompt_style",
            "phi-1",
        ]
    if resume:
        args += ["--resume", str(resume_path(out, script))]
    return args


def resume_path(out: Path, script: str) -> Path:
    first = out.parent / out.name.removesuffix("-resume")
    return first / ("step-00000002" if script == "pretrain" else "step-000002") / "lit_model.pth"


def eager_ddp(find_unused_parameters: bool):
    """Fabric's DDP building the model eagerly under ``init_module(empty_init=True)`` too: the reference
    every stage must equal (values and RNG stream of eager construction)."""
    from lightning.fabric.strategies import DDPStrategy

    class EagerInitDDP(DDPStrategy):
        def module_init_context(self, empty_init=None):
            return super().module_init_context(empty_init=False)

    return EagerInitDDP(find_unused_parameters=find_unused_parameters)


@contextmanager
def strategy_for(strategy: str, find_unused_parameters: bool) -> Iterator[None]:
    """``ddp``: every ``L.Fabric`` LitGPT builds gets :func:`eager_ddp` (``run`` itself passes the
    string ``"ddp"`` through, which keeps Fabric's ``empty_init``). ``ddp1``: the same on one
    process, where LitGPT asks for ``strategy="auto"``: its training Fabric (the one given a
    strategy) gets :func:`eager_ddp` too, so its sampler is the DistributedSampler of one replica
    that a layout of dp 1 (tp 2 x cp 2 on 4 processes) gets."""
    if strategy == "ddp1":
        with one_process_ddp(find_unused_parameters):
            yield
        return
    if strategy != "ddp":
        yield
        return
    from lightning_zero.fabric import litgpt as wrapper

    make = wrapper.make_strategy
    wrapper.make_strategy = lambda **options: eager_ddp(find_unused_parameters)
    try:
        yield
    finally:
        wrapper.make_strategy = make


@contextmanager
def one_process_ddp(find_unused_parameters: bool) -> Iterator[None]:
    import lightning

    from lightning_zero.fabric._compat import fabric_class_replaced

    original = lightning.Fabric

    class Fabric(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs) -> None:
            if "strategy" in kwargs:  # LitGPT's training Fabric; merge_lora's keeps its own
                kwargs["strategy"] = eager_ddp(find_unused_parameters)
            super().__init__(*args, **kwargs)

    with fabric_class_replaced(Fabric):
        yield


def run_case(root: Path, case: str) -> dict:
    script, strategy, precision, *rest = case.split("-")
    if script == "reseed":
        return reseed_case(root, strategy)
    resume, generate, no_dropout = rest == ["resume"], rest == ["generate"], rest == ["nodropout"]
    out = root / "runs" / case
    ddp = "ddp_find_unused_parameters_true" if script == "adapter" else "ddp"  # LitGPT's adapter leaves some unused
    options = {"stage": ddp if strategy.startswith("ddp") else strategy[4], "state_dict_type": "full"}
    layout = re.fullmatch(r"zero\d(?:tp(\d+))?(?:cp(\d+))?(?:defer)?", strategy)
    tp, cp = (int(layout[1] or 1), int(layout[2] or 1)) if layout else (1, 1)
    model_parallel = tp * cp
    if cp > 1:  # zero1cp2: stage 1, cp=2 (the wrapper's --cp)
        options["cp"] = cp
    if tp > 1:  # zero1tp2: stage 1, tp=2 with sequence parallelism (the wrapper's --tp)
        options.update(tensor_parallel_size=tp, sequence_parallel=True)
    if strategy.endswith("defer"):  # zero2defer, zero3defer: gradients stay local over the accumulated micro batches
        options["defer_grad_reduce"] = True
    if generate and strategy != "ddp":
        options["collective_timeout"] = 60.0  # a stalled rank-0 generation fails in a minute, naming the wait
    generated: list = []
    started = time.perf_counter()
    with recording_generations(generated, enabled=generate), strategy_for(strategy, script == "adapter"):
        argv = command(root, script, strategy, precision, out, resume, generate, model_parallel)
        run(argv + (["--lora_dropout", "0"] if no_dropout else []), options)
    return {"seconds": time.perf_counter() - started, "generated": generated}


def reseed_case(root: Path, strategy: str) -> dict:
    """LitGPT's GPT under ``init_module(empty_init=True)``, reseeded, then ``reset_parameters(model)``
    (LitGPT's pretrain order with a seed set between); two AdamW steps with dropout. Records the weights
    after setup (full, gathered at stage 3), the losses, and ``torch.rand`` after the steps."""
    import lightning as L
    from litgpt.model import GPT, Config
    from litgpt.utils import reset_parameters

    from lightning_zero.fabric.litgpt import make_strategy

    started = time.perf_counter()
    made = eager_ddp(False) if strategy == "ddp" else make_strategy(stage=int(strategy[4]))
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=made, precision="32-true")
    fabric.launch()
    fabric.seed_everything(1337)
    with fabric.init_module(empty_init=True):
        model = GPT(Config(**CONFIG))
    fabric.seed_everything(42)  # between construction and the initializer: its draws use this seed
    reset_parameters(model)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    out = root / "runs" / f"reseed-{strategy}-32"
    out.mkdir(parents=True, exist_ok=True)
    data = torch.randint(0, CONFIG["padded_vocab_size"], (4, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # stage 3 materializes at the first forward (before it, stand-ins: NaN)
        model(data[:1, :-1])
    weights = {name: value.detach().clone() for name, value in model.state_dict().items()}
    dropout = torch.nn.Dropout(0.1)  # the caller's stream after init: as ddp's eager run left it
    losses = []
    for step in range(2):
        inputs = data[2 * fabric.global_rank + step % 2 : 2 * fabric.global_rank + step % 2 + 1]
        logits = model(inputs[:, :-1])
        loss = torch.nn.functional.cross_entropy(dropout(logits).flatten(0, 1), inputs[:, 1:].flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    after = {name: value.detach().clone() for name, value in model.state_dict().items()}
    draw = torch.rand(4).tolist()
    fabric.strategy.teardown()
    if fabric.global_rank == 0:
        torch.save({"init": weights, "trained": after}, out / "weights.pt")
    return {"seconds": time.perf_counter() - started, "losses": losses, "draw": draw}


@contextmanager
def recording_generations(generated: list, enabled: bool) -> Iterator[None]:
    """The token ids of every ``generate`` LitGPT's ``finetune_lora`` runs in its ``generate_example``
    (on rank 0 only), recorded by wrapping the module's ``generate`` (the script is unchanged)."""
    if not enabled:
        yield
        return
    import litgpt.finetune.lora as lora_script

    original = lora_script.generate

    def recorded(*args, **kwargs):
        output = original(*args, **kwargs)
        generated.append(output.tolist())
        return output

    lora_script.generate = recorded
    try:
        yield
    finally:
        lora_script.generate = original


if __name__ == "__main__":
    root, *cases = sys.argv[1:]
    root = Path(root)
    prepare(root)
    results = {}
    for case in cases:
        try:
            results[case] = run_case(root, case)
        except BaseException:  # noqa: BLE001 - recorded for the test; the next case still runs
            results[case] = {"exception": traceback.format_exc()}
            print(results[case]["exception"], file=sys.stderr, flush=True)
            break
    (root / f"results.{'_'.join(cases)[:80]}.rank{RANK}.json").write_text(json.dumps(results))
