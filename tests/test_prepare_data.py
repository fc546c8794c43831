"""``lightning-zero prepare-data``: a BPE tokenizer trained here, several processes, EOS between
documents; the ids equal the tokenizer's own encoding, the file trains, a too-small model refuses it."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from lightning_zero.data import TokenDataModule, open_tokens, read_token_meta  # noqa: E402
from tests.test_cli import read_metrics, run_cli  # noqa: E402

VOCAB = 300


def _stdlib_texts(count: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    names = ["textwrap.py", "fnmatch.py", "colorsys.py", "bisect.py", "keyword.py", "glob.py", "shlex.py", "heapq.py"]
    return [(root / name).read_text()[:6000] for name in names[:count]]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    root = tmp_path_factory.mktemp("prep")
    texts = _stdlib_texts(8)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer.save(str(root / "tokenizer.json"))
    # Inputs: two plain files (one document each) and a .jsonl of the other six.
    inputs = [root / "a.txt", root / "b.py", root / "c.jsonl"]
    inputs[0].write_text(texts[0])
    inputs[1].write_text(texts[1])
    inputs[2].write_text("".join(json.dumps({"text": text, "id": i}) + "\n" for i, text in enumerate(texts[2:])))
    return {
        "root": root,
        "tokenizer": Tokenizer.from_file(str(root / "tokenizer.json")),
        "texts": texts,
        "inputs": inputs,
    }


def _expected_ids(corpus) -> np.ndarray:
    tokenizer = corpus["tokenizer"]
    eos = tokenizer.token_to_id("</s>")
    ids: list[int] = []
    for text in corpus["texts"]:
        ids += tokenizer.encode(text).ids + [eos]
    return np.asarray(ids)


def test_prepare_data_ids_equal_the_tokenizers_encoding(corpus, capsys):
    from lightning_zero.cli import main

    out = corpus["root"] / "train.bin"
    main(
        [
            "prepare-data",
            *map(str, corpus["inputs"]),
            str(out),
            "--tokenizer",
            str(corpus["root"]),
            "--workers",
            "2",
            "--no-progress",
        ]
    )
    assert "8 documents" in capsys.readouterr().out
    meta = read_token_meta(out)
    assert meta["vocab_size"] == corpus["tokenizer"].get_vocab_size() == VOCAB
    assert meta["dtype"] == "uint16" and meta["num_documents"] == 8
    tokens = np.asarray(open_tokens(out, meta["dtype"]))
    expected = _expected_ids(corpus)
    assert tokens[0] == corpus["tokenizer"].token_to_id("<s>")  # the tokenizer's own BOS
    np.testing.assert_array_equal(tokens, expected)
    assert meta["num_tokens"] == expected.size


def test_prepare_data_refuses_bad_input(corpus, tmp_path):
    from lightning_zero.data import prepare_tokens

    with pytest.raises(ValueError, match="not found"):
        prepare_tokens([tmp_path / "nope.txt"], tmp_path / "x.bin", corpus["root"])
    with pytest.raises(ValueError, match="no tokenizer.json"):
        prepare_tokens(corpus["inputs"][:1], tmp_path / "x.bin", tmp_path)
    with pytest.raises(ValueError, match="--eos-token '<nope>' is not in"):
        prepare_tokens(corpus["inputs"][:1], tmp_path / "x.bin", corpus["root"], eos_token="<nope>", progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: expected a JSON object with a 'text' string"):
        prepare_tokens([bad], tmp_path / "x.bin", corpus["root"], workers=1, progress=False)
    assert not (tmp_path / "x.bin").exists()


def test_token_file_trains_and_a_smaller_vocab_is_refused(corpus, tmp_path):
    from lightning_zero.data import prepare_tokens

    out = tmp_path / "train.bin"
    prepare_tokens(corpus["inputs"], out, corpus["root"] / "tokenizer.json", workers=1, progress=False)
    with pytest.raises(ValueError, match=r"tokenized with a vocabulary of 300 .* larger than vocab_size 256"):
        TokenDataModule("memmap", path=str(out), vocab_size=256, seq_len=32).setup()
    proc = run_cli(
        ["train", "data=memmap", f"data.path={out}", f"model.vocab_size={VOCAB}", "data.seq_len=32", "data.batch_size=2",
         "trainer.max_steps=4", "trainer.devices=1", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
         "model.n_layers=1", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:]
    losses = [float(row["train_loss"]) for row in read_metrics(tmp_path / "run") if row.get("train_loss")]
    assert len(losses) == 4 and all(np.isfinite(losses))
    # ... and the same command with a model whose vocabulary is too small stops before training
    proc = run_cli(["train", "data=memmap", f"data.path={out}", "trainer.devices=1", "trainer.max_steps=1",
                    f"hydra.run.dir={tmp_path / 'run2'}"], cwd=tmp_path)  # fmt: skip
    assert proc.returncode != 0 and "tokenized with a vocabulary of 300" in proc.stdout


# The Llama 3 tokenizer.json layout: byte-level BPE behind Llama 3's split regex (no prefix space),
# the special tokens after the BPE vocabulary (<|begin_of_text|>, <|end_of_text|>, reserved ones,
# <|eot_id|>), a post-processor that prepends <|begin_of_text|>.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def _llama3_tokenizer(path: Path, texts: list[str], specials: list[str]) -> Path:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_tokens(["</s>"])  # ordinary text in a big byte-level vocabulary: never the EOS
    tokenizer.add_special_tokens(specials)
    if "<|begin_of_text|>" in specials:
        bos = tokenizer.token_to_id("<|begin_of_text|>")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
        )
    tokenizer.save(str(path))
    return path


def test_prepare_data_with_a_llama3_tokenizer(corpus, tmp_path):
    from tokenizers import Tokenizer

    from lightning_zero.data import prepare_tokens

    reserved = [f"<|reserved_special_token_{i}|>" for i in range(4)]
    specials = ["<|begin_of_text|>", "<|end_of_text|>", *reserved, "<|eot_id|>"]
    path = _llama3_tokenizer(tmp_path / "tokenizer.json", corpus["texts"], specials)
    tokenizer = Tokenizer.from_file(str(path))
    eot = tokenizer.token_to_id("<|end_of_text|>")
    assert eot > VOCAB and tokenizer.token_to_id("</s>") is not None  # both exist; the special one wins
    out = tmp_path / "train.bin"
    prepare_tokens(corpus["inputs"], out, path, workers=2, progress=False)
    meta = read_token_meta(out)
    assert meta["eos_id"] == eot and meta["num_documents"] == 8
    tokens = np.asarray(open_tokens(out, meta["dtype"]))
    expected = []
    for text in corpus["texts"]:
        expected += tokenizer.encode(text).ids + [eot]
    np.testing.assert_array_equal(tokens, np.asarray(expected))
    assert tokens[0] == tokenizer.token_to_id("<|begin_of_text|>") and (tokens == eot).sum() == 8
    # A chat tokenizer that only has <|eot_id|> ends documents with it.
    chat = _llama3_tokenizer(tmp_path / "chat.json", corpus["texts"][:2], ["<|eot_id|>"])
    prepare_tokens(corpus["inputs"][:1], tmp_path / "chat.bin", chat, workers=1, progress=False)
    assert read_token_meta(tmp_path / "chat.bin")["eos_id"] == Tokenizer.from_file(str(chat)).token_to_id("<|eot_id|>")
