"""TokenDataModule: sources, windows, determinism, dp sharding, memmap round trip, corpus cache."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_zero import data
from lightning_zero.data import TokenDataModule, build_corpus, synthetic_tokens, write_tokens

SMALL = dict(source="synthetic", seq_len=16, batch_size=4, vocab_size=50, synthetic_tokens=4000, val_fraction=0.1)


def make(**overrides) -> TokenDataModule:
    module = TokenDataModule(**{**SMALL, **overrides})
    module.setup("fit")
    return module


def epoch_batches(module: TokenDataModule, epoch: int = 0) -> list[torch.Tensor]:
    loader = module.train_dataloader()
    loader.sampler.set_epoch(epoch)
    return list(loader)


def window_ids(module: TokenDataModule, epoch: int = 0) -> list[int]:
    loader = module.train_dataloader()
    loader.sampler.set_epoch(epoch)
    return list(loader.sampler)


def test_batches_are_long_windows_of_the_stream():
    module = make()
    stream = synthetic_tokens(4000, 50, seed=1234)
    batch = epoch_batches(module)[0]
    assert batch.dtype == torch.long and batch.shape == (4, 17)
    first = window_ids(module)[0]
    torch.testing.assert_close(batch[0], torch.from_numpy(stream[first * 16 : first * 16 + 17].astype(np.int64)))
    # 3999 // 16 = 249 windows: 25 for validation (the last ones), 224 to train.
    assert (len(module.train_set), len(module.val_set)) == (224, 25)
    assert module.val_set.first_window == 224


def test_order_is_deterministic_per_seed_and_epoch():
    first, again, other_seed = make(), make(), make(seed=99)
    for left, right in zip(epoch_batches(first), epoch_batches(again)):
        torch.testing.assert_close(left, right)
    assert window_ids(first, epoch=0) != window_ids(first, epoch=1)
    assert window_ids(first, epoch=1) == window_ids(again, epoch=1)
    assert window_ids(first) != window_ids(other_seed)


@pytest.mark.parametrize("dp_size", [2, 3])
def test_dp_ranks_read_disjoint_windows_of_equal_count(dp_size):
    per_rank = [window_ids(make(dp_rank=rank, dp_size=dp_size)) for rank in range(dp_size)]
    assert len({len(ids) for ids in per_rank}) == 1
    seen = [window for ids in per_rank for window in ids]
    assert len(seen) == len(set(seen)) == 224 - 224 % dp_size
    # Together the ranks cover the global permutation, rank r at positions r, r + dp, ...
    assert window_ids(make())[:6] == [per_rank[i % dp_size][i // dp_size] for i in range(6)]


def test_dp_coordinates_come_from_the_strategy_then_the_process_group(monkeypatch):
    module = make()
    assert module.data_parallel() == (0, 1)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    assert module.data_parallel() == (1, 2)
    # A strategy with tensor parallelism reports dp coordinates, which win over the world's.
    strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 0})
    module.trainer = SimpleNamespace(strategy=strategy)
    assert module.data_parallel() == (0, 2)
    assert window_ids(module) == window_ids(make(dp_rank=0, dp_size=2))
    # Lightning only re-wraps samplers that are not DistributedSampler; ours must stay one.
    assert isinstance(module.train_dataloader().sampler, DistributedSampler)
    assert isinstance(module.val_dataloader().sampler, DistributedSampler)


def test_validation_is_in_order_and_padded_to_equal_batches():
    loaders = [make(dp_rank=rank, dp_size=2).val_dataloader() for rank in range(2)]
    counts = [sum(batch.size(0) for batch in loader) for loader in loaders]
    assert counts == [13, 13]  # 25 windows padded to 26
    assert list(loaders[0].sampler)[:3] == [0, 2, 4]
    assert make(val_fraction=0.0).val_dataloader() == []


@pytest.mark.parametrize(
    "suffix, vocab_size, dtype", [(".bin", 1000, "uint16"), (".bin", 70000, "uint32"), (".npy", 1000, "uint16")]
)
def test_memmap_round_trip(tmp_path, suffix, vocab_size, dtype):
    tokens = np.random.default_rng(0).integers(0, vocab_size, size=1000)
    path = write_tokens(tmp_path / f"tokens{suffix}", tokens)
    assert path.stat().st_size >= 1000 * np.dtype(dtype).itemsize
    module = make(
        source="memmap", path=str(path), vocab_size=vocab_size, synthetic_tokens=2, seq_len=10, val_fraction=0
    )
    for index in (0, 7, len(module.train_set) - 1):
        np.testing.assert_array_equal(module.train_set[index].numpy(), tokens[index * 10 : index * 10 + 11])
    worker_loader = torch.utils.data.DataLoader(module.train_set, batch_size=4, num_workers=1)
    np.testing.assert_array_equal(next(iter(worker_loader))[1].numpy(), tokens[10:21])


@pytest.mark.parametrize(
    "file_tokens, kwargs, match",
    [
        (np.arange(101), dict(vocab_size=50), r"token id \d+ in window \d+ .* >= vocab_size \(50\)"),
        (None, dict(), r"does not exist; write one with lightning_zero.data.write_tokens"),
        (np.arange(101), dict(dtype="uint32"), r"holds 202 bytes, not a whole number of uint32 tokens"),
    ],
)
def test_memmap_errors(tmp_path, file_tokens, kwargs, match):
    path = tmp_path / "tokens.bin"
    if file_tokens is not None:
        write_tokens(path, file_tokens, dtype="uint16")
    settings = {**dict(source="memmap", path=str(path), vocab_size=200, seq_len=10, val_fraction=0), **kwargs}
    with pytest.raises(ValueError, match=match):
        module = make(**settings)
        [module.train_set[i] for i in range(len(module.train_set))]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(source="wiki"), r"source must be one of \('corpus', 'memmap', 'synthetic'\), got 'wiki'"),
        (dict(source="memmap"), r"path is required for source='memmap'"),
        (dict(path="x.bin"), r"path is required for source='memmap' and only for it \(source='synthetic'"),
        (dict(seq_len=0), r"seq_len must be an int >= 1, got 0"),
        (dict(batch_size=2.5), r"batch_size must be an int >= 1, got 2.5"),
        (dict(source="corpus", vocab_size=100), r"vocab_size must be >= 256, got 100"),
        (dict(val_fraction=1.0), r"val_fraction must be in \[0, 1\), got 1.0"),
        (dict(dtype="int8"), r"dtype must be 'auto' or one of \('uint16', 'uint32'\), got 'int8'"),
        (dict(dp_rank=2, dp_size=2), r"0 <= dp_rank < dp_size.*\(dp_rank=2, dp_size=2\)"),
        (dict(dp_rank=0), r"give both dp_rank and dp_size"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TokenDataModule(**{**SMALL, **kwargs})


def test_too_little_data_names_the_numbers():
    with pytest.raises(ValueError, match=r"40 tokens make 2 windows of seq_len 16, 2 of them for validation"):
        make(synthetic_tokens=40, val_fraction=0.9)
    with pytest.raises(ValueError, match=r"224 train windows cannot fill one batch of 100 on each of 3"):
        make(batch_size=100, dp_rank=0, dp_size=3).train_dataloader()


def test_corpus_is_stdlib_text_built_once_then_cached(tmp_path, monkeypatch):
    path = build_corpus(tmp_path, max_bytes=200_000)
    tokens = np.fromfile(path, dtype=np.uint16)
    assert tokens.size == 200_000 and tokens.max() < 256
    text = tokens.astype(np.uint8).tobytes().decode("utf-8", errors="ignore")
    assert text.startswith("# ") and "def " in text and '"""' in text
    monkeypatch.setattr(data, "write_tokens", lambda *a, **k: pytest.fail("corpus rebuilt despite the cache"))
    assert build_corpus(tmp_path, max_bytes=200_000) == path
    module = TokenDataModule(source="corpus", cache_dir=str(tmp_path), corpus_max_bytes=200_000, seq_len=64)
    module.prepare_data()
    module.setup("fit")
    assert next(iter(module.train_dataloader())).shape == (8, 65)
    assert list(tmp_path.iterdir()) == [path]  # no temporary files left behind


def test_corpus_skips_tests_and_site_packages():
    names = {file.name for file in data.stdlib_source_files()}
    parts = {part for file in data.stdlib_source_files() for part in file.parts}
    assert "os.py" in names and "json" in parts
    assert not parts & {"site-packages", "test", "idle_test"}
