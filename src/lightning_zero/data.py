"""Token data for next-token training: one 1-D token stream, cut into windows, split, shuffled, sharded.

Three sources give the stream:

- ``corpus``: real text that exists on every machine without a download: the source (and so the
  docstrings) of the installed Python standard library, as byte-level tokens (ids 0-255). Built
  once, then cached as a token file under ``cache_dir``.
- ``memmap``: a pre-tokenized file, the usual format for large runs: raw little-endian ``uint16``
  / ``uint32`` ids (``.bin``, as nanoGPT writes them) or a ``.npy`` array, memory-mapped.
- ``synthetic``: deterministic random tokens with repeated motifs (learnable by copying), for tests.

[Note: windows, split and order] The stream of ``N`` tokens holds ``(N - 1) // seq_len`` windows;
window ``i`` is tokens ``[i * seq_len, i * seq_len + seq_len + 1)``, so one sample gives inputs
``[:-1]`` and targets ``[1:]``. The last ``val_fraction`` of the windows (a contiguous range) is
the validation split. Each epoch the train windows are permuted from ``(seed, epoch)``;
data-parallel rank ``r`` of ``dp`` takes permutation positions ``r, r + dp, r + 2 dp, ...``
(torch's ``DistributedSampler``, which Lightning leaves in place and advances with
``set_epoch``), cut to the same length on every rank. Ranks of one tensor-parallel group share a
dp rank and so read the same batches.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

SOURCES = ("corpus", "memmap", "synthetic")
TOKEN_DTYPES = ("uint16", "uint32")
BYTE_VOCAB = 256

# Directory names under the standard library that are not its own source.
_CORPUS_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


# --------------------------------------------------------------------------------------------
# Token files
# --------------------------------------------------------------------------------------------


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest token file dtype that holds ids below ``vocab_size``."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def write_tokens(path: Union[str, Path], tokens: np.ndarray, dtype: Optional[str] = None) -> Path:
    """Write 1-D token ids to ``path`` (``.npy``: numpy format, otherwise raw ``.bin``), atomically.

    ``dtype`` (``uint16``/``uint32``) defaults to the smallest that holds ``max(tokens)``.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size == 0 or tokens.dtype.kind not in "iu":
        raise ValueError(f"write_tokens: tokens must be a non-empty 1-D integer array, got {tokens.dtype} {tokens.shape}")
    low, high = int(tokens.min()), int(tokens.max())
    dtype = np.dtype(dtype) if dtype is not None else token_dtype(high + 1)
    if dtype.name not in TOKEN_DTYPES:
        raise ValueError(f"write_tokens: dtype must be one of {TOKEN_DTYPES}, got {dtype.name}")
    if low < 0 or high > np.iinfo(dtype).max:
        raise ValueError(f"write_tokens: ids span [{low}, {high}], which {dtype.name} cannot hold")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write next to the target, then rename: concurrent writers (ranks) never expose a partial file.
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as handle:
        if path.suffix == ".npy":
            np.save(handle, tokens.astype(dtype))
        else:
            tokens.astype(dtype).tofile(handle)
    os.replace(handle.name, path)
    return path


def open_tokens(path: Union[str, Path], dtype: Union[str, np.dtype]) -> np.ndarray:
    """Memory-map a token file read-only: ``.npy`` keeps its own dtype, raw files use ``dtype``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"token file {str(path)!r} does not exist; write one with lightning_zero.data.write_tokens")
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or tokens.dtype.name not in TOKEN_DTYPES + ("int32", "int64"):
            raise ValueError(f"{str(path)!r}: expected a 1-D integer array, got {tokens.dtype} {tokens.shape}")
        return tokens
    dtype = np.dtype(dtype)
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise ValueError(
            f"{str(path)!r} holds {size} bytes, not a whole number of {dtype.name} tokens "
            f"({dtype.itemsize} bytes each); pass the dtype it was written with"
        )
    return np.memmap(path, dtype=dtype, mode="r")


# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$LIGHTNING_ZERO_CACHE``, else ``~/.cache/lightning_zero``."""
    return Path(os.environ.get("LIGHTNING_ZERO_CACHE", Path.home() / ".cache" / "lightning_zero"))


def stdlib_source_files(stdlib_dir: Optional[Union[str, Path]] = None) -> list[Path]:
    """The ``.py`` files of the standard library, sorted by relative path, without tests and site-packages."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(name for name in dirnames if name not in _CORPUS_SKIP_DIRS)
        files.extend(Path(dirpath, name) for name in filenames if name.endswith(".py"))
    return sorted(files, key=lambda file: file.relative_to(root).as_posix())


def build_corpus(
    cache_dir: Optional[Union[str, Path]] = None,
    max_bytes: int = 16 * 2**20,
    stdlib_dir: Optional[Union[str, Path]] = None,
) -> Path:
    """Byte-level token file of the standard library's source, at most ``max_bytes`` tokens.

    Files are concatenated in sorted order, each after a ``# <relative path>`` line; files that are
    not UTF-8 are skipped. The result is cached under a name that hashes the Python version, the
    file list (path, size, mtime) and ``max_bytes``, so a second call only stats files.
    """
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    files = stdlib_source_files(root)
    if not files:
        raise ValueError(
            f"no Python source found under {str(root)!r} to build the default corpus; "
            "use source='memmap' with a token file or source='synthetic'"
        )
    key = hashlib.sha256(f"{sys.version}|{max_bytes}".encode())
    for file in files:
        stat = file.stat()
        key.update(f"|{file.relative_to(root).as_posix()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    out = Path(cache_dir or default_cache_dir()) / f"stdlib-py{version}-{key.hexdigest()[:16]}.bin"
    if out.is_file():
        return out
    chunks, total = [], 0
    for file in files:
        if total >= max_bytes:
            break
        text = file.read_bytes()
        try:
            text.decode("utf-8")
        except UnicodeDecodeError:
            continue
        chunk = f"# {file.relative_to(root).as_posix()}\n".encode() + text + b"\n\n"
        chunks.append(chunk[: max_bytes - total])
        total += len(chunks[-1])
    return write_tokens(out, np.frombuffer(b"".join(chunks), dtype=np.uint8), dtype="uint16")


def synthetic_tokens(num_tokens: int, vocab_size: int, seed: int) -> np.ndarray:
    """Deterministic stream of segments, each a random motif of 2-16 ids repeated 4-16 times.

    Within a segment the next id is predictable by copying from one period back, so a small
    model's loss falls well below ``ln(vocab_size)`` quickly.
    """
    rng = np.random.default_rng(seed)
    tokens = np.empty(num_tokens, dtype=token_dtype(vocab_size))
    position = 0
    while position < num_tokens:
        motif = rng.integers(0, vocab_size, size=int(rng.integers(2, 17)))
        segment = np.tile(motif, int(rng.integers(4, 17)))[: num_tokens - position]
        tokens[position : position + segment.size] = segment
        position += segment.size
    return tokens


# --------------------------------------------------------------------------------------------
# Dataset and data module
# --------------------------------------------------------------------------------------------


class TokenWindows(Dataset):
    """Windows ``first_window .. first_window + num_windows - 1`` of a token stream, as
    ``LongTensor[seq_len + 1]`` (see [Note: windows, split and order]).

    ``tokens`` is an array (kept) or a token file path (memory-mapped lazily in each process, so a
    DataLoader worker re-opens the file instead of receiving a copy).
    """

    def __init__(
        self,
        tokens: Union[np.ndarray, str, Path],
        seq_len: int,
        first_window: int,
        num_windows: int,
        vocab_size: int,
        dtype: Union[str, np.dtype] = "uint16",
    ) -> None:
        self.seq_len = seq_len
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
        window = np.asarray(self.tokens()[start : start + self.seq_len + 1], dtype=np.int64)
        if window.max() >= self.vocab_size:
            raise ValueError(
                f"token id {int(window.max())} in window {self.first_window + index} of "
                f"{self._path or 'the token stream'} is >= vocab_size ({self.vocab_size}); "
                "raise data vocab_size (and the model's) or re-tokenize"
            )
        return torch.from_numpy(window)

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
            raise ValueError(f"token file {str(path)!r} holds {recorded.name} ids ({token_meta_path(path)}), dtype={self.dtype.name} was given")
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

    def train_dataloader(self) -> DataLoader:
        dataset = self._require(self.train_set)
        dp_rank, dp_size = self.data_parallel()
        if len(dataset) < dp_size * self.batch_size:
            raise ValueError(
                f"TokenDataModule: {len(dataset)} train windows cannot fill one batch of {self.batch_size} "
                f"on each of {dp_size} data-parallel ranks; lower batch_size or seq_len, or add tokens"
            )
        sampler = ResumableSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=self.seed, drop_last=True)
        return self._loader(
            dataset,
            sampler,
            drop_last=True,
            loader_cls=ResumableDataLoader,
            generator=torch.Generator().manual_seed(self.seed),  # worker seeds; keeps the global RNG untouched
        )

    def val_dataloader(self) -> Union[DataLoader, list]:
        dataset = self._require(self.val_set)
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


# --------------------------------------------------------------------------------------------
# Resumable position
# --------------------------------------------------------------------------------------------


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` that can start an epoch part-way through its permutation.

    [Note: data position] Rank ``r`` of ``dp`` takes permutation positions ``r, r + dp, ...``, so
    after ``k`` batches of ``B`` per rank the whole run has consumed exactly the first
    ``k * B * dp`` positions of the epoch's permutation (a prefix). ``start_position`` skips that
    prefix and deals the rest round-robin again, over however many ranks the resumed run has: at
    the same dp the resumed run sees exactly the batches the uninterrupted one would; at another
    dp it sees the same remaining samples of the epoch in the same global order, grouped into
    batches of the new global size. A new epoch starts from position 0.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.start_position = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start_position = 0
        super().set_epoch(epoch)

    def __iter__(self):
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator).tolist()
        else:
            order = list(range(len(self.dataset)))
        if len(order) < self.total_size:  # DistributedSampler pads when not drop_last
            order += order[: self.total_size - len(order)]
        remaining = order[self.start_position : self.total_size]
        per_rank = len(remaining) // self.num_replicas
        return iter(remaining[self.rank : per_rank * self.num_replicas : self.num_replicas])


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` with ``state_dict``/``load_state_dict`` (Lightning saves them in the fit
    loop's checkpoint state) holding the epoch and the global positions consumed so far.

    ``len()`` stays the full epoch's batch count, as Lightning expects from a resumed loader.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._iter_start = 0
        self._yielded = 0

    def __iter__(self):
        sampler = self.sampler
        self._iter_start, self._yielded = sampler.start_position, 0
        for batch in super().__iter__():
            self._yielded += 1
            yield batch
        sampler.start_position = 0

    def __len__(self) -> int:
        sampler = self.sampler
        return (sampler.total_size // sampler.num_replicas) // self.batch_size

    def state_dict(self) -> dict:
        sampler = self.sampler
        consumed = self._iter_start + self._yielded * self.batch_size * sampler.num_replicas
        return {"epoch": sampler.epoch, "consumed": consumed, "seed": sampler.seed, "num_samples": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        sampler = self.sampler
        if state.get("seed") != sampler.seed or state.get("num_samples") != len(self.dataset):
            raise ValueError(
                f"ResumableDataLoader.load_state_dict: the checkpoint's data (seed {state.get('seed')},"
                f" {state.get('num_samples')} samples) is not this loader's (seed {sampler.seed},"
                f" {len(self.dataset)} samples); resume with the same data and seed"
            )
        sampler.epoch = int(state["epoch"])
        sampler.start_position = int(state["consumed"])
        self._iter_start, self._yielded = sampler.start_position, 0


# --------------------------------------------------------------------------------------------
# Tokenizing text into a token file (``lightning-zero prepare-data``)
# --------------------------------------------------------------------------------------------

# Names tokenizers give their end-of-document token, in the order they are tried.
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]")
_worker_tokenizer: Any = None


def token_meta_path(path: Union[str, Path]) -> Path:
    """The JSON file next to a token file that records how it was made (``train.bin.json``)."""
    return Path(str(path) + ".json")


def read_token_meta(path: Union[str, Path]) -> Optional[dict[str, Any]]:
    """What :func:`prepare_tokens` recorded next to ``path`` (vocab size, dtype, ...), or ``None``."""
    meta_path = token_meta_path(path)
    if not meta_path.is_file():
        return None
    import json

    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as exc:
        raise ValueError(f"{meta_path}: unreadable token file metadata ({exc})") from exc
    if not isinstance(meta, dict) or "vocab_size" not in meta or "dtype" not in meta:
        raise ValueError(f"{meta_path}: token file metadata must record 'vocab_size' and 'dtype'")
    return meta


def load_tokenizer(path: Union[str, Path]) -> Any:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` file or a directory holding one."""
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"--tokenizer {str(path)!r}: no tokenizer.json there (a Hugging Face fast-tokenizer file)")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the library raises its own Exception type
        raise ValueError(f"{file}: not a tokenizers tokenizer.json ({exc})") from exc


def _find_eos(tokenizer: Any, eos_token: Optional[str], where: Path) -> int:
    names = (eos_token,) if eos_token else EOS_CANDIDATES
    for name in names:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return int(token_id)
    if eos_token:
        raise ValueError(f"{where}: --eos-token {eos_token!r} is not in the tokenizer's vocabulary")
    raise ValueError(f"{where}: found none of the end-of-document tokens {list(EOS_CANDIDATES)}; pass --eos-token")


def _documents(inputs: list[Path], text_key: str) -> Any:
    """(text, bytes consumed) per document: a ``.jsonl`` line's ``text_key`` field, or a whole file."""
    import json

    for path in inputs:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as handle:
                for line_number, line in enumerate(handle, start=1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)[text_key]
                    except (ValueError, KeyError, TypeError) as exc:
                        raise ValueError(f"{path}:{line_number}: expected a JSON object with a {text_key!r} string ({exc})") from exc
                    yield str(text), len(line.encode("utf-8"))
        else:
            data = path.read_bytes()
            yield data.decode("utf-8", errors="replace"), len(data)


def _batches(documents: Any, docs_per_batch: int) -> Any:
    batch: list[str] = []
    size = 0
    for text, nbytes in documents:
        batch.append(text)
        size += nbytes
        if len(batch) == docs_per_batch:
            yield batch, size
            batch, size = [], 0
    if batch:
        yield batch, size


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(tokenizer_path)


def _encode_batch(job: tuple[list[str], int, int, str]) -> tuple[np.ndarray, int, int]:
    """Token ids of a batch of documents, each followed by ``eos_id``; (ids, documents, bytes)."""
    texts, nbytes, eos_id, dtype = job
    pieces = []
    for encoding in _worker_tokenizer.encode_batch(texts):
        ids = encoding.ids
        pieces.append(np.asarray(ids, dtype=np.int64))
        if not ids or ids[-1] != eos_id:
            pieces.append(np.asarray([eos_id], dtype=np.int64))
    return np.concatenate(pieces).astype(dtype), len(texts), nbytes


def prepare_tokens(
    inputs: list[Union[str, Path]],
    out: Union[str, Path],
    tokenizer: Union[str, Path],
    *,
    workers: Optional[int] = None,
    text_key: str = "text",
    eos_token: Optional[str] = None,
    docs_per_batch: int = 64,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize text files into the token file ``data=memmap`` reads; returns what it recorded.

    Documents: each line of a ``.jsonl`` file (its ``text_key`` field) or each other file whole.
    Each is encoded with the tokenizer's own ``encode`` (its special tokens, e.g. a BOS, included)
    and followed by the end-of-document token (``eos_token``, else the first of
    ``EOS_CANDIDATES`` the vocabulary has), unless it already ends with it. ``workers``
    processes encode batches of ``docs_per_batch`` documents; the results are written in input
    order, streaming, as raw ``uint16`` ids (``uint32`` when the vocabulary exceeds 65536) into
    ``out`` (atomically), and ``out.json`` records the vocabulary size, dtype, EOS id, token and
    document counts. Training refuses a token file whose recorded vocabulary exceeds the model's.
    """
    import json
    import multiprocessing

    from tqdm.auto import tqdm

    paths = [Path(p) for p in inputs]
    missing = [str(p) for p in paths if not p.is_file()]
    if not paths or missing:
        raise ValueError(f"prepare-data: input file(s) not found: {missing or 'none given'}")
    tokenizer_path = Path(tokenizer)
    loaded = load_tokenizer(tokenizer_path)
    vocab_size = int(loaded.get_vocab_size(with_added_tokens=True))
    eos_id = _find_eos(loaded, eos_token, tokenizer_path)
    dtype = token_dtype(vocab_size)
    workers = max(1, workers or min(8, os.cpu_count() or 1))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    total_bytes = sum(p.stat().st_size for p in paths)
    num_tokens = num_docs = 0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # processes, not threads, share the work
    file_for = str(tokenizer_path / "tokenizer.json" if tokenizer_path.is_dir() else tokenizer_path)
    jobs = ((texts, nbytes, eos_id, dtype.name) for texts, nbytes in _batches(_documents(paths, text_key), docs_per_batch))
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"tokenizing ({workers} processes)", disable=not progress)
    pool = None
    with tempfile.NamedTemporaryFile(dir=out.parent, prefix=out.name, suffix=".tmp", delete=False) as handle:
        try:
            if workers == 1:
                _init_worker(file_for)
                results = map(_encode_batch, jobs)
            else:
                pool = multiprocessing.get_context().Pool(workers, initializer=_init_worker, initargs=(file_for,))
                results = pool.imap(_encode_batch, jobs)
            for ids, docs, nbytes in results:
                ids.tofile(handle)
                num_tokens += ids.size
                num_docs += docs
                bar.update(nbytes)
            if pool is not None:
                pool.close()
                pool.join()
        except BaseException:
            if pool is not None:
                pool.terminate()
            os.unlink(handle.name)
            raise
        finally:
            bar.close()
    if num_tokens == 0:
        os.unlink(handle.name)
        raise ValueError(f"prepare-data: no documents in {[str(p) for p in paths]}")
    os.replace(handle.name, out)
    meta = {
        "format": "lightning_zero.tokens/1",
        "dtype": dtype.name,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "num_tokens": num_tokens,
        "num_documents": num_docs,
        "tokenizer": str(Path(file_for).resolve()),
        "inputs": [str(p) for p in paths],
    }
    token_meta_path(out).write_text(json.dumps(meta, indent=2) + "\n")
    return meta
