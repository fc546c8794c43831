"""Peak host memory of a Hugging Face import, against the checkpoint's largest tensor.

Usage: python tests/scripts/hf_import_memory.py OUT_DIR   (prints one JSON line)
A Llama whose embedding and head are 16 MiB each in fp32 (vocab 8192 x dim 512) is saved as
safetensors (fp32, and bf16: the load then casts through a bounded buffer). Our model is built on
the meta device and materialized (every page touched) first; the peak-RSS mark is then reset and
every unit is read from the files (``HFLlamaWeights.load``, the per-unit hook every layout uses).
``peak_growth``: the peak RSS during the reads minus the RSS before them.
"""

import json
import os
import sys

import torch

torch.set_num_threads(1)

from lightning_zero.models import Llama, LlamaConfig  # noqa: E402
from lightning_zero.models.llama.hf import HFLlamaWeights  # noqa: E402


def rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak() -> int:
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmHWM:"))


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def main(out: str) -> None:
    from lightning_zero.checkpoint.hf_write import save_hf_pretrained
    from lightning_zero.checkpoint.targets import RankPlacement

    config = LlamaConfig(name="mem", vocab_size=8192, dim=512, n_layers=1, n_heads=8, n_kv_heads=4, ffn_dim=1536,
                         max_seq_len=64)  # fmt: skip
    source = Llama(config)
    largest = max(p.numel() * 4 for p in source.parameters())
    for dtype in ("fp32", "bf16"):
        save_hf_pretrained(os.path.join(out, dtype), module=source, engine=None, layout=RankPlacement(),
                           dtype=None if dtype == "fp32" else dtype, max_shard_size="50MB")  # fmt: skip
    del source
    record = {"largest_tensor": largest, "model_bytes": config.num_params() * 4}
    for case, directory in (("fp32", "fp32"), ("bf16_file", "bf16")):
        weights = HFLlamaWeights(os.path.join(out, directory), config)
        with torch.device("meta"):
            model = Llama(config)
        model.to_empty(device="cpu")
        for param in model.parameters():
            param.data.zero_()  # every page resident before the reads
        before = rss()
        reset_peak()
        for name, module in (
            [("tok_embeddings", model.tok_embeddings)]
            + [(f"layers.{i}", layer) for i, layer in enumerate(model.layers)]
            + [("norm", model.norm), ("output", model.output)]
        ):
            weights.load(module, name + ".")
        record[case] = {"peak_growth": peak() - before, "bytes_read": weights.bytes_read}
        del model, weights
    print(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1])
