"""``lightning-zero prepare-data``: tokenize text (or ``.jsonl``) files with a local
``tokenizer.json`` in several processes into the token file ``data=memmap`` reads."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from lightning_zero.data.tokens import token_dtype, token_meta_path

# Names tokenizers give their end-of-document token, in the order they are tried (Llama 2: </s>;
# GPT-2: <|endoftext|>; Llama 3: <|end_of_text|>, and <|eot_id|> for a chat-only tokenizer).
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]", "<|eot_id|>")


_worker_tokenizer: Any = None


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
    """The id of ``eos_token``, else of the first candidate that is a *special* token, else of the
    first candidate in the vocabulary. Special tokens first: a 128K byte-level vocabulary (Llama 3)
    may hold ``</s>`` as ordinary text, which must not end documents when ``<|end_of_text|>`` exists."""
    names = (eos_token,) if eos_token else EOS_CANDIDATES
    special = {
        token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items() if token.special
    }
    for name in names:
        if name in special:
            return int(special[name])
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
                        raise ValueError(
                            f"{path}:{line_number}: expected a JSON object with a {text_key!r} string ({exc})"
                        ) from exc
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
    jobs = (
        (texts, nbytes, eos_id, dtype.name) for texts, nbytes in _batches(_documents(paths, text_key), docs_per_batch)
    )
    bar = tqdm(
        total=total_bytes, unit="B", unit_scale=True, desc=f"tokenizing ({workers} processes)", disable=not progress
    )
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
