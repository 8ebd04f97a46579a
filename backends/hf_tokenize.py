"""`pipelang tokenize TEXT -o TOKENS --model hf:DIR`: a text file as the token ids
`run --data` reads, made with the model's own tokenizer (`DIR/tokenizer.json`, read by
the `tokenizers` library, offline).

- The tokenizer: `DIR/tokenizer.json`, a regular file of at most `TOKENIZER_BYTES`,
  strict JSON, an object with a `model`, that `tokenizers.Tokenizer.from_str` accepts.
- TEXT: a regular file of UTF-8 text, read in pieces of about `PIECE_CHARS` characters,
  so memory stays bounded whatever its size. A piece ends at a line break followed by a
  character that is not white space, where the families' pre-tokenizers (byte-level
  BPE, whitespace, SentencePiece's metaspace) split anyway, so the ids are those of the
  whole text encoded at once (a line over `LONGEST` pieces is cut at a space, or
  anywhere: only there may the ids differ). No special tokens
  are added (no BOS per piece): the ids are the text's own, one stream.
- TOKENS: `.bin`, little-endian uint16 (nanoGPT's layout, what `--data` reads as
  token ids), for a vocabulary of at most 65,536 ids; `.npy`, a 1-D array of uint16
  (a vocabulary up to 65,536) or uint32 (larger ones). Written to a temporary file
  beside it and renamed when complete.

Every problem is a `TokenizeError`, one line (exit 1); a bad command line (`-o` of
another kind, or unwritable) is the CLI's usage error.
"""

from __future__ import annotations

import codecs
import importlib.util
import os
import stat
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelang.backends.hf_config import EXTRA, located
from pipelang.diagnostics import quote
from pipelang.readers import ReadError, read_json, read_text

TOKENIZER = "tokenizer.json"
TOKENIZER_BYTES = 64 * 2**20
"""The largest tokenizer.json read (the largest released ones are about 35 MB)."""
PIECE_CHARS = 2**20
"""About how many characters of TEXT are encoded at once."""
LONGEST = 16
"""A piece longer than this many `PIECE_CHARS` without a place to end (one huge line)
ends at its last space, or anywhere: the ids may differ from the whole text's there."""
FORMATS = (".bin", ".npy")
NPY_HEADER = 128
"""The bytes of the `.npy` header written: room for any count of ids."""


class TokenizeError(Exception):
    """TEXT, the tokenizer or TOKENS cannot be used; one line."""


@dataclass(frozen=True, slots=True)
class Tokenized:
    """What `tokenize` wrote."""

    tokens: int
    dtype: str
    vocab: int


def extra_problem() -> str | None:
    """Why `tokenize` cannot run here (the `tokenizers` library missing); None if it can."""
    if importlib.util.find_spec("tokenizers") is None:
        return f"`pipelang tokenize` needs the Hugging Face extra (tokenizers): {EXTRA}"
    return None


def output_problem(out: Path) -> str | None:
    """Why `-o out` is no token file `--data` reads as ids; None if it is."""
    if out.suffix not in FORMATS:
        return (
            f"-o {quote(out)}: give a .bin (uint16 ids) or .npy file, the token files "
            "--data reads as ids (any other file it reads as bytes)"
        )
    return None


def load_tokenizer(directory: Path) -> Any:
    """`DIR/tokenizer.json` as a `tokenizers.Tokenizer` (see the module docstring)."""
    from tokenizers import Tokenizer

    path = directory / TOKENIZER
    where = located(path)
    if not path.is_file():
        what = "is not a regular file" if path.exists() else "is missing"
        raise TokenizeError(
            f"{where} {what}: `pipelang tokenize` needs the model's tokenizer "
            "(save it with the tokenizer's save_pretrained)"
        )
    try:
        text = read_text(path, TOKENIZER_BYTES)
        parsed = read_json(text)
    except ReadError as err:
        raise TokenizeError(f"{where}: {err}") from None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("model"), dict):
        raise TokenizeError(f"{where}: not a tokenizer (a JSON object with a `model`)")
    try:
        return Tokenizer.from_str(text)
    except Exception as err:  # the library's own words on what it cannot build
        lines = str(err).strip().splitlines()
        said = quote(lines[0]) if lines else type(err).__name__
        raise TokenizeError(
            f"{where}: not a tokenizer the `tokenizers` library reads: {said}"
        ) from None


def dtype_for(vocab: int, out: Path) -> str:
    """The numpy dtype of TOKENS' ids for a vocabulary of `vocab` ids."""
    if vocab <= 2**16:
        return "<u2"
    if out.suffix == ".bin":
        raise TokenizeError(
            f"the tokenizer has {vocab:,} ids, more than the 65,536 a .bin file's uint16 "
            f"holds: give -o {quote(out.with_suffix('.npy'))} (uint32 ids)"
        )
    if vocab <= 2**32:
        return "<u4"
    raise TokenizeError(f"the tokenizer has {vocab:,} ids, more than uint32 holds")


def pieces(path: Path, size: int = PIECE_CHARS) -> Iterator[tuple[str, int]]:
    """TEXT in pieces (see the module docstring), each with the bytes read so far."""
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise TokenizeError(f"TEXT {quote(path)} is not a regular file")
        file = path.open("rb")
    except OSError as err:
        raise TokenizeError(f"cannot read TEXT {quote(path)}: {err.strerror or err}") from None
    decoder = codecs.getincrementaldecoder("utf-8")()
    done, pending = 0, ""
    with file:
        while True:
            try:
                data = file.read(size)
            except OSError as err:
                raise TokenizeError(f"cannot read TEXT {quote(path)}: {err.strerror}") from None
            buffered = len(decoder.getstate()[0])
            try:
                new = decoder.decode(data, final=not data)
            except UnicodeDecodeError as err:
                at = done - buffered + err.start
                raise TokenizeError(
                    f"TEXT {quote(path)} is not UTF-8 text (at byte {at:,})"
                ) from None
            done += len(data)
            if not data:
                break
            since = max(0, len(pending) - 1)
            pending += new
            cut = _cut(pending, since, len(pending) > LONGEST * size)
            if cut:
                yield pending[:cut], done
                pending = pending[cut:]
    if pending:
        yield pending, done


def _cut(text: str, since: int, forced: bool) -> int:
    """Where `text` may end a piece: after its last line break at or past `since`
    followed by a character that is not white space; 0 where there is none. `forced`
    (a piece too long): at its last white space, or its end."""
    at = len(text) - 1
    while True:
        at = text.rfind("\n", since, at)
        if at < 0:
            break
        if not text[at + 1].isspace():
            return at + 1
    if not forced:
        return 0
    space = max(text.rfind(" "), text.rfind("\n"))
    return space + 1 if space > 0 else len(text)


def tokenize(
    text: Path,
    directory: Path,
    out: Path,
    progress: Callable[[int, int, int], None] | None = None,
    piece_chars: int = PIECE_CHARS,
) -> Tokenized:
    """Write the ids of `text` under `directory`'s tokenizer to `out`; `progress(bytes
    done, bytes in all, tokens)` after each piece."""
    import numpy as np

    problem = output_problem(out)
    if problem is not None:
        raise TokenizeError(problem)
    tokenizer = load_tokenizer(directory)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = dtype_for(vocab, out)
    try:
        total = text.stat().st_size
    except OSError as err:
        raise TokenizeError(f"cannot read TEXT {quote(text)}: {err.strerror or err}") from None
    temporary = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    count = 0
    try:
        with temporary.open("wb") as file:
            if out.suffix == ".npy":
                file.write(_npy_header(dtype, 0))
            for piece, done in pieces(text, piece_chars):
                ids = tokenizer.encode(piece, add_special_tokens=False).ids
                file.write(np.asarray(ids, dtype=dtype).tobytes())
                count += len(ids)
                if progress is not None:
                    progress(done, total, count)
            if count == 0:
                raise TokenizeError(f"TEXT {quote(text)} gives no tokens")
            if out.suffix == ".npy":
                file.seek(0)
                file.write(_npy_header(dtype, count))
        os.replace(temporary, out)
    except OSError as err:
        raise TokenizeError(f"cannot write {quote(out)}: {err.strerror or err}") from None
    finally:
        temporary.unlink(missing_ok=True)
    return Tokenized(count, "uint16" if dtype == "<u2" else "uint32", vocab)


def _npy_header(dtype: str, count: int) -> bytes:
    """A `.npy` (version 1.0) header of `NPY_HEADER` bytes for `count` ids."""
    described = f"{{'descr': '{dtype}', 'fortran_order': False, 'shape': ({count},), }}"
    body = described.ljust(NPY_HEADER - 10 - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body.encode("ascii")
