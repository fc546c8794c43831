"""Token streams that need no download: the installed standard library's source as byte-level
tokens (built once, cached), and deterministic synthetic tokens for tests."""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path
from typing import Optional, Union

import numpy as np

from lightning_zero.data.tokens import token_dtype, write_tokens

# Directory names under the standard library that are not its own source.
_CORPUS_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


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
