"""Token data for next-token training: one 1-D token stream, cut into windows, split, shuffled, sharded.

One job a module: ``tokens`` (token files), ``corpus`` (the standard-library corpus, synthetic
tokens), ``datamodule`` (``TokenDataModule``), ``resumable`` (the data position across resumes)
and ``prepare`` (``lightning-zero prepare-data``).

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

from lightning_zero.data.corpus import build_corpus, default_cache_dir, stdlib_source_files, synthetic_tokens
from lightning_zero.data.datamodule import SOURCES, TokenDataModule, TokenWindows
from lightning_zero.data.prepare import load_tokenizer, prepare_tokens
from lightning_zero.data.resumable import ResumableDataLoader, ResumableSampler
from lightning_zero.data.tokens import (
    BYTE_VOCAB,
    TOKEN_DTYPES,
    open_tokens,
    read_token_meta,
    token_dtype,
    token_meta_path,
    write_tokens,
)

__all__ = [
    "BYTE_VOCAB",
    "SOURCES",
    "TOKEN_DTYPES",
    "ResumableDataLoader",
    "ResumableSampler",
    "TokenDataModule",
    "TokenWindows",
    "build_corpus",
    "default_cache_dir",
    "load_tokenizer",
    "open_tokens",
    "prepare_tokens",
    "read_token_meta",
    "stdlib_source_files",
    "synthetic_tokens",
    "token_dtype",
    "token_meta_path",
    "write_tokens",
]
