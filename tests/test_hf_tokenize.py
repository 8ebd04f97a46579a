"""`pipelang tokenize TEXT -o TOKENS --model hf:DIR` (issue 42): a text file as `--data`'s
token ids, with DIR/tokenizer.json.

Oracle: the `tokenizers` library's own `Tokenizer.from_file(...).encode(text).ids` on the
whole text at once (tokenize reads it in pieces); the ids then train a step of the model."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers", reason="the hf extra is not installed: pip install pipelang[hf]")
pytest.importorskip(
    "transformers", reason="the hf extra is not installed: pip install pipelang[hf]"
)

import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from pipelang.backends.hf_tokenize import tokenize
from tests.helpers import run_in_process

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "and",
    "then",
    "the",
    "dog",
    "ran",
    "far",
    "away",
    "from",
    "it",
    "all",
]


def _text(lines: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(lines):
        words = rng.choice(WORDS, size=int(rng.integers(1, 12)))
        indent = "  " if i % 7 == 3 else ""  # a line break before white space: no cut
        out.append(indent + " ".join(words) + ("\n\n" if i % 5 == 0 else "\n"))
    return "".join(out)


def _word_level() -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    tokenizer.train_from_iterator([_text(50)], trainer)
    return tokenizer


def _byte_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=90, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([_text(50)], trainer)
    return tokenizer


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny llama config (vocabulary 300) beside each tokenizer."""
    root = tmp_path_factory.mktemp("tok")
    made = {}
    for name, tokenizer in (("word", _word_level()), ("bpe", _byte_bpe())):
        directory = root / name
        transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_hidden_layers=2,
            max_position_embeddings=64,
            vocab_size=300,
        ).save_pretrained(directory)
        tokenizer.save(str(directory / "tokenizer.json"))
        made[name] = directory
    return made


@pytest.mark.parametrize("name", ["word", "bpe"])
@pytest.mark.parametrize("suffix", [".bin", ".npy"])
def test_pieces_give_the_whole_texts_ids(
    name: str, suffix: str, models_dir: dict[str, Path], tmp_path: Path
) -> None:
    """Read in pieces of 100 characters (a few hundred of them), the ids are those of
    the whole text encoded at once, as uint16 in the format --data reads."""
    text = tmp_path / "corpus.txt"
    text.write_text(_text(400, seed=1))
    out = tmp_path / f"tokens{suffix}"
    seen: list[tuple[int, int, int]] = []
    done = tokenize(text, models_dir[name], out, lambda *a: seen.append(a), piece_chars=100)
    expected = Tokenizer.from_file(str(models_dir[name] / "tokenizer.json")).encode(
        text.read_text()
    )
    if suffix == ".npy":
        ids = np.load(out)
        assert ids.dtype == np.uint16
    else:
        ids = np.fromfile(out, dtype="<u2")
    assert ids.tolist() == expected.ids
    assert done.tokens == len(expected.ids) and done.dtype == "uint16"
    assert len(seen) > 50 and seen[-1] == (text.stat().st_size, text.stat().st_size, done.tokens)


@pytest.mark.slow
def test_the_tokens_train_the_model(
    models_dir: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pipelang tokenize` then `pipelang run --model hf:DIR --data TOKENS`: a step (the
    relative `t.npy` in a folder of the test's own, not the checkout)."""
    monkeypatch.chdir(tmp_path)
    text = tmp_path / "corpus.txt"
    text.write_text(_text(200))
    model = f"hf:{models_dir['word']}"
    status, out, err = run_in_process(["tokenize", str(text), "-o", "t.npy", "--model", model])
    assert status == 0, err
    count = len(Tokenizer.from_file(str(models_dir["word"] / "tokenizer.json")).encode(_text(200)))
    vocab = Tokenizer.from_file(str(models_dir["word"] / "tokenizer.json")).get_vocab_size()
    assert out.strip() == (
        f"wrote {count:,} tokens (uint16, a vocabulary of {vocab}) to t.npy: pipelang run ... "
        f"--model {model} --data t.npy"
    )
    argv = ["run", "1f1b", "-p", "D=2", "-p", "N=2", "--model", model, "--data", "t.npy"]
    status, _, err = run_in_process([*argv, "--seq-len", "8", "--backend", "local", "--steps", "1"])
    assert status == 0, err
    assert "step 1/1  loss" in err


# ---- refused ----------------------------------------------------------------------------------


def _tokenize(text: Path | str, out: Path | str, directory: Path) -> tuple[int, str]:
    status, _, err = run_in_process(
        ["tokenize", str(text), "-o", str(out), "--model", f"hf:{directory}"]
    )
    lines = err.strip().splitlines()
    return status, lines[-1] if lines else ""


@pytest.fixture
def broken(models_dir: dict[str, Path], tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    for file in models_dir["word"].iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    return directory


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "is missing: `pipelang tokenize` needs the model's tokenizer"),
        ("{not json", ": it is not JSON: Expecting property name enclosed in double quotes"),
        ("[1]", ": not a tokenizer (a JSON object with a `model`)"),
        ('{"model": {"type": "Nonsense"}}', ": not a tokenizer the `tokenizers` library reads: "),
        ("[" * 100_000 + "]" * 100_000, ": it nests arrays and objects too deep"),
        ('{"x": "' + "a" * (64 * 2**20) + '"}', ": it is larger than 64 MiB"),
    ],
    ids=["missing", "not-json", "a-list", "not-a-tokenizer", "deep", "huge"],
)
def test_a_tokenizer_that_cannot_be_read_is_one_line(
    content: str | None, message: str, broken: Path, tmp_path: Path
) -> None:
    (tmp_path / "corpus.txt").write_text("the cat\n")
    path = broken / "tokenizer.json"
    if content is None:
        path.unlink()
    else:
        path.write_text(content)
    status, err = _tokenize(tmp_path / "corpus.txt", tmp_path / "t.bin", broken)
    assert status == 1
    assert err.startswith(f"error: `tokenizer.json` in `{broken}`") and message in err, err
    assert not (tmp_path / "t.bin").exists()


def test_a_tokenizer_that_is_a_fifo_is_not_opened(broken: Path, tmp_path: Path) -> None:
    (broken / "tokenizer.json").unlink()
    os.mkfifo(broken / "tokenizer.json")
    (tmp_path / "corpus.txt").write_text("the cat\n")
    status, err = _tokenize(tmp_path / "corpus.txt", tmp_path / "t.bin", broken)
    assert status == 1
    assert err == (
        f"error: `tokenizer.json` in `{broken}` is not a regular file: `pipelang tokenize` "
        "needs the model's tokenizer (save it with the tokenizer's save_pretrained)"
    )


def test_a_text_that_cannot_be_read_is_one_line(
    models_dir: dict[str, Path], tmp_path: Path
) -> None:
    directory = models_dir["word"]
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"the cat\n" * 10 + b"\xff sat\n")
    os.mkfifo(tmp_path / "fifo")
    cases = {
        tmp_path / "nothing.txt": f"cannot read TEXT `{tmp_path / 'nothing.txt'}`: No such file "
        "or directory",
        tmp_path: f"TEXT `{tmp_path}` is not a regular file",
        tmp_path / "fifo": f"TEXT `{tmp_path / 'fifo'}` is not a regular file",
        bad: f"TEXT `{bad}` is not UTF-8 text (at byte 80)",
    }
    for text, message in cases.items():
        status, err = _tokenize(text, tmp_path / "t.bin", directory)
        assert (status, err) == (1, f"error: {message}")
    (tmp_path / "empty.txt").write_text("  \n")
    status, err = _tokenize(tmp_path / "empty.txt", tmp_path / "t.bin", directory)
    assert (status, err) == (1, f"error: TEXT `{tmp_path / 'empty.txt'}` gives no tokens")
    assert not (tmp_path / "t.bin").exists()


def test_a_vocabulary_too_big_for_bin_is_one_line(broken: Path, tmp_path: Path) -> None:
    vocab = {f"w{i}": i for i in range(70_000)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(broken / "tokenizer.json"))
    (tmp_path / "corpus.txt").write_text("w69999 w3\n")
    status, err = _tokenize(tmp_path / "corpus.txt", tmp_path / "t.bin", broken)
    assert (status, err) == (
        1,
        "error: the tokenizer has 70,000 ids, more than the 65,536 a .bin file's uint16 holds: "
        f"give -o `{tmp_path / 't.npy'}` (uint32 ids)",
    )
    status, _ = _tokenize(tmp_path / "corpus.txt", tmp_path / "t.npy", broken)
    assert status == 0
    assert np.load(tmp_path / "t.npy").tolist() == [69999, 3]
    assert np.load(tmp_path / "t.npy").dtype == np.uint32


def test_a_bad_output_or_model_is_a_usage_error(
    models_dir: dict[str, Path], tmp_path: Path
) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("the cat\n")
    (tmp_path / "file").write_text("x")
    directory = models_dir["word"]
    cases = [
        (
            [str(text), "-o", "t.txt", "--model", f"hf:{directory}"],
            "-o `t.txt`: give a .bin (uint16 ids) or .npy file, the token files --data reads "
            "as ids (any other file it reads as bytes)",
        ),
        (
            [str(text), "-o", str(tmp_path / "file" / "t.bin"), "--model", f"hf:{directory}"],
            f"cannot write `{tmp_path / 'file' / 't.bin'}`: File exists",  # `file` is one
        ),
        (
            [str(text), "-o", "t.bin", "--model", "gpt:tiny"],
            "--model `gpt:tiny`: tokenize reads a checkpoint's tokenizer: give hf:DIR",
        ),
    ]
    for argv, message in cases:
        status, _, err = run_in_process(["tokenize", *argv])
        assert (status, err.strip().splitlines()[-1]) == (2, f"pipelang tokenize: error: {message}")
    status, _, err = run_in_process(["tokenize", str(text), "--model", f"hf:{directory}"])
    assert status == 2 and "the following arguments are required: -o" in err


def test_without_the_extra_the_error_names_it(
    models_dir: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "tokenizers" else real(n, *a)
    )
    (tmp_path / "corpus.txt").write_text("the cat\n")
    status, err = _tokenize(tmp_path / "corpus.txt", tmp_path / "t.bin", models_dir["word"])
    assert (status, err) == (
        2,
        "pipelang tokenize: error: `pipelang tokenize` needs the Hugging Face extra "
        "(tokenizers): pip install pipelang[hf]",
    )
