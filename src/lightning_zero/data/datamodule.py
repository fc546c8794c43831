"""``TokenDataModule``: windows of one token stream, split, shuffled and sharded over dp ranks
(see [Note: windows, split and order] in ``data/__init__.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_zero.cp.layout import context_slice_bounds
from lightning_zero.data.corpus import build_corpus, synthetic_tokens
from lightning_zero.data.resumable import ResumableDataLoader, ResumableSampler
from lightning_zero.data.tokens import (
    BYTE_VOCAB,
    TOKEN_DTYPES,
    open_tokens,
    read_token_meta,
    token_dtype,
    token_meta_path,
)

SOURCES = ("corpus", "memmap", "synthetic")


class TokenWindows(Dataset):
    """Windows ``first_window .. first_window + num_windows - 1`` of a token stream, as
    ``LongTensor[seq_len + 1]`` (see [Note: windows, split and order]).

    ``tokens`` is an array (kept) or a token file path (memory-mapped lazily in each process, so a
    DataLoader worker re-opens the file instead of receiving a copy).

    ``cp_rank``/``cp_size``: under context parallelism each window is read as cp rank
    ``cp_rank``'s slice, ``LongTensor[seq_len / cp_size + 1]``: its inputs and their labels, the
    last of which is the next slice's first token ([Note: context-parallel layout] in ``cp/layout.py``).
    """

    def __init__(
        self,
        tokens: Union[np.ndarray, str, Path],
        seq_len: int,
        first_window: int,
        num_windows: int,
        vocab_size: int,
        dtype: Union[str, np.dtype] = "uint16",
        cp_rank: int = 0,
        cp_size: int = 1,
    ) -> None:
        self.seq_len = seq_len
        self.slice_start, self.slice_stop = context_slice_bounds(seq_len, cp_size, cp_rank)
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.first_window = first_window
        self.num_windows = num_windows
        self.vocab_size = vocab_size
        self.dtype = np.dtype(dtype)
        self._path = None if isinstance(tokens, np.ndarray) else str(tokens)
        self._tokens = tokens if isinstance(tokens, np.ndarray) else None

    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = open_tokens(self._path, self.dtype)
        return self._tokens

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.num_windows:
            raise IndexError(f"window {index} out of range [0, {self.num_windows})")
        start = (self.first_window + index) * self.seq_len
        window = np.asarray(self.tokens()[start + self.slice_start : start + self.slice_stop], dtype=np.int64)
        if window.max() >= self.vocab_size:
            raise ValueError(
                f"token id {int(window.max())} in window {self.first_window + index} of "
                f"{self._path or 'the token stream'} is >= vocab_size ({self.vocab_size}); "
                "raise data vocab_size (and the model's) or re-tokenize"
            )
        return torch.from_numpy(window)

    def context_slice(self, cp_rank: int, cp_size: int) -> "TokenWindows":
        """The same windows, read as cp rank ``cp_rank``'s slices (see the class doc)."""
        source = self._tokens if self._path is None else self._path
        return TokenWindows(source, self.seq_len, self.first_window, self.num_windows, self.vocab_size,
                            self.dtype, cp_rank, cp_size)  # fmt: skip

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self._path is not None:
            state["_tokens"] = None  # re-open the memmap in the receiving process
        return state


class TokenDataModule(L.LightningDataModule):
    """Batches of token ids ``LongTensor[batch_size, seq_len + 1]`` from one of three sources.

    Args:
        source: ``corpus`` (standard-library text, byte tokens; needs ``vocab_size >= 256``),
            ``memmap`` (a token file at ``path``) or ``synthetic``.
        path: the token file for ``source="memmap"`` (``.bin`` raw ids or ``.npy``).
        seq_len: tokens the model sees per sample; each sample carries one more for the targets.
        batch_size: samples per batch on each data-parallel rank.
        vocab_size: ids must be below it; also picks a ``.bin`` file's dtype when ``dtype="auto"``.
        seed: fixes the synthetic stream and the per-epoch order.
        val_fraction: share of windows, taken from the end of the stream, for validation; in [0, 1).
        num_workers: DataLoader worker processes per rank.
        dtype: ``auto`` (uint16 when ``vocab_size <= 65536``, else uint32), ``uint16`` or ``uint32``;
            the dtype of a ``.bin`` token file.
        cache_dir: where the built corpus is cached (default ``$LIGHTNING_ZERO_CACHE`` or
            ``~/.cache/lightning_zero``).
        corpus_max_bytes: cap on the corpus size in tokens (= bytes).
        synthetic_tokens: length of the synthetic stream.
        dp_rank, dp_size: this rank's data-parallel coordinates; ``None`` takes them from the
            trainer's strategy (``distributed_sampler_kwargs``), else from the initialized default
            process group, else ``(0, 1)``.
        cp_rank, cp_size: this rank's context-parallel coordinates: each batch then holds its
            ``seq_len / cp_size`` slice of every window plus the label after it,
            ``LongTensor[batch_size, seq_len / cp_size + 1]`` ([Note: context-parallel layout] in
            ``cp/layout.py``); cp ranks of one dp rank get the same windows. ``None`` takes them from
            the trainer's strategy (its layout's ``cp`` group), else ``(0, 1)``.
    """

    def __init__(
        self,
        source: str = "corpus",
        path: Optional[str] = None,
        seq_len: int = 256,
        batch_size: int = 8,
        vocab_size: int = BYTE_VOCAB,
        seed: int = 1234,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        *,
        dtype: str = "auto",
        cache_dir: Optional[str] = None,
        corpus_max_bytes: int = 16 * 2**20,
        synthetic_tokens: int = 2**20,
        dp_rank: Optional[int] = None,
        dp_size: Optional[int] = None,
        cp_rank: Optional[int] = None,
        cp_size: Optional[int] = None,
    ) -> None:
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"TokenDataModule: source must be one of {SOURCES}, got {source!r}")
        if (source == "memmap") != (path is not None):
            raise ValueError(
                f"TokenDataModule: path is required for source='memmap' and only for it "
                f"(source={source!r}, path={path!r})"
            )
        for name, value, low in (
            ("seq_len", seq_len, 1),
            ("batch_size", batch_size, 1),
            ("vocab_size", vocab_size, 2),
            ("num_workers", num_workers, 0),
            ("corpus_max_bytes", corpus_max_bytes, 2),
            ("synthetic_tokens", synthetic_tokens, 2),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"TokenDataModule: {name} must be an int >= {low}, got {value!r}")
        if source == "corpus" and vocab_size < BYTE_VOCAB:
            raise ValueError(
                f"TokenDataModule: the corpus uses byte tokens (ids 0-255), so vocab_size must be >= "
                f"{BYTE_VOCAB}, got {vocab_size}"
            )
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"TokenDataModule: val_fraction must be in [0, 1), got {val_fraction}")
        if dtype != "auto" and dtype not in TOKEN_DTYPES:
            raise ValueError(f"TokenDataModule: dtype must be 'auto' or one of {TOKEN_DTYPES}, got {dtype!r}")
        if (dp_rank is None) != (dp_size is None) or (dp_size is not None and not 0 <= dp_rank < dp_size):
            raise ValueError(
                f"TokenDataModule: give both dp_rank and dp_size with 0 <= dp_rank < dp_size, or neither "
                f"(dp_rank={dp_rank}, dp_size={dp_size})"
            )
        if (cp_rank is None) != (cp_size is None) or (cp_size is not None and not 0 <= cp_rank < cp_size):
            raise ValueError(
                f"TokenDataModule: give both cp_rank and cp_size with 0 <= cp_rank < cp_size, or neither "
                f"(cp_rank={cp_rank}, cp_size={cp_size})"
            )
        if cp_size is not None:
            context_slice_bounds(seq_len, cp_size, cp_rank)  # seq_len must split over cp
        self.save_hyperparameters()
        self.source = source
        self.path = path
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.vocab_size = vocab_size
        self.seed = seed
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.dtype = token_dtype(vocab_size) if dtype == "auto" else np.dtype(dtype)
        self.cache_dir = cache_dir
        self.corpus_max_bytes = corpus_max_bytes
        self.synthetic_tokens = synthetic_tokens
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.cp_rank = cp_rank
        self.cp_size = cp_size
        self.train_set: Optional[TokenWindows] = None
        self.val_set: Optional[TokenWindows] = None

    def prepare_data(self) -> None:
        """Build the corpus cache (Lightning calls this on one process per node)."""
        if self.source == "corpus":
            build_corpus(self.cache_dir, self.corpus_max_bytes)

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        tokens: Union[np.ndarray, Path]
        if self.source == "synthetic":
            tokens = synthetic_tokens(self.synthetic_tokens, self.vocab_size, self.seed)
            num_tokens, dtype = tokens.size, tokens.dtype
        else:
            # Building here too is safe: writes are atomic and the content is deterministic.
            path = build_corpus(self.cache_dir, self.corpus_max_bytes) if self.source == "corpus" else Path(self.path)
            dtype = np.dtype("uint16") if self.source == "corpus" else self._memmap_dtype(path)
            stream = open_tokens(path, dtype)
            tokens, num_tokens, dtype = path, stream.size, stream.dtype
        num_windows = (num_tokens - 1) // self.seq_len
        num_val = 0 if self.val_fraction == 0 else max(1, round(num_windows * self.val_fraction))
        num_train = num_windows - num_val
        if num_train < 1:
            raise ValueError(
                f"TokenDataModule: {num_tokens} tokens make {num_windows} windows of seq_len {self.seq_len}, "
                f"{num_val} of them for validation, none left to train on; use more tokens, a smaller "
                "seq_len or a smaller val_fraction"
            )
        self.train_set = TokenWindows(tokens, self.seq_len, 0, num_train, self.vocab_size, dtype)
        self.val_set = TokenWindows(tokens, self.seq_len, num_train, num_val, self.vocab_size, dtype)

    def _memmap_dtype(self, path: Path) -> np.dtype:
        """The token file's dtype; with a ``prepare-data`` record next to it (``<file>.json``),
        refuse a file whose tokenizer vocabulary does not fit ``vocab_size`` (the model's)."""
        meta = read_token_meta(path)
        if meta is None:
            return self.dtype
        recorded = np.dtype(meta["dtype"])
        if int(meta["vocab_size"]) > self.vocab_size:
            raise ValueError(
                f"token file {str(path)!r} was tokenized with a vocabulary of {meta['vocab_size']} "
                f"({meta.get('tokenizer', 'unknown tokenizer')}), larger than vocab_size {self.vocab_size} (the model's): "
                "its ids could index past the embedding; use the model's own tokenizer or a model with a larger vocabulary"
            )
        if self.hparams.get("dtype", "auto") != "auto" and recorded != self.dtype:
            raise ValueError(
                f"token file {str(path)!r} holds {recorded.name} ids ({token_meta_path(path)}), dtype={self.dtype.name} was given"
            )
        return recorded

    def data_parallel(self) -> tuple[int, int]:
        """``(dp_rank, dp_size)`` of this process (see the ``dp_rank`` argument)."""
        if self.dp_size is not None:
            return self.dp_rank, self.dp_size
        strategy = self.trainer.strategy if self.trainer is not None else None
        sampler_kwargs = getattr(strategy, "distributed_sampler_kwargs", None) if strategy is not None else None
        if sampler_kwargs:
            return int(sampler_kwargs["rank"]), int(sampler_kwargs["num_replicas"])
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def context_parallel(self) -> tuple[int, int]:
        """``(cp_rank, cp_size)`` of this process (see the ``cp_rank`` argument): the strategy's
        layout (``mesh_groups``: its ``cp`` group) when it has one."""
        if self.cp_size is not None:
            return self.cp_rank, self.cp_size
        strategy = self.trainer.strategy if self.trainer is not None else None
        groups = getattr(strategy, "mesh_groups", None) if strategy is not None else None
        if groups is not None and groups.dims.cp > 1:
            return groups.rank_in("cp"), groups.dims.cp
        return 0, 1

    def _sliced(self, dataset: TokenWindows) -> TokenWindows:
        """``dataset`` as this rank's context-parallel slices (itself when cp is 1)."""
        cp_rank, cp_size = self.context_parallel()
        return dataset if cp_size == 1 else dataset.context_slice(cp_rank, cp_size)

    def train_dataloader(self) -> DataLoader:
        dataset = self._sliced(self._require(self.train_set))
        dp_rank, dp_size = self.data_parallel()
        if len(dataset) < dp_size * self.batch_size:
            raise ValueError(
                f"TokenDataModule: {len(dataset)} train windows cannot fill one batch of {self.batch_size} "
                f"on each of {dp_size} data-parallel ranks; lower batch_size or seq_len, or add tokens"
            )
        sampler = ResumableSampler(
            dataset, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=self.seed, drop_last=True
        )
        return self._loader(
            dataset,
            sampler,
            drop_last=True,
            loader_cls=ResumableDataLoader,
            generator=torch.Generator().manual_seed(self.seed),  # worker seeds; keeps the global RNG untouched
        )

    def val_dataloader(self) -> Union[DataLoader, list]:
        dataset = self._sliced(self._require(self.val_set))
        if len(dataset) == 0:  # val_fraction=0: no validation loaders
            return []
        dp_rank, dp_size = self.data_parallel()
        # In order; the sampler pads with repeats so every rank runs the same number of batches.
        sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=False, drop_last=False)
        return self._loader(dataset, sampler, drop_last=False)

    def _loader(
        self,
        dataset: TokenWindows,
        sampler: DistributedSampler,
        drop_last: bool,
        loader_cls: type = DataLoader,
        **extra: Any,
    ) -> DataLoader:
        return loader_cls(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=drop_last,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            **extra,
        )

    def _require(self, dataset: Optional[TokenWindows]) -> TokenWindows:
        if dataset is None:
            raise RuntimeError("TokenDataModule: call setup() before asking for data loaders")
        return dataset
