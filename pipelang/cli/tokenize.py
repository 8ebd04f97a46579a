"""`pipelang tokenize TEXT -o TOKENS --model hf:DIR`: a text file as `run --data`'s token
ids, with the model's own tokenizer (backends/hf_tokenize.py does the work)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipelang.cli.args import UsageError, model_name, path, writable
from pipelang.diagnostics import quote

HELP = "turn a text file into token ids for `run --data`, with DIR/tokenizer.json of --model hf:DIR"


def setup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text", type=path, metavar="TEXT", help="the UTF-8 text file to tokenize")
    parser.add_argument(
        "-o",
        dest="out",
        type=path,
        required=True,
        metavar="TOKENS",
        help="where the ids go: FILE.bin (little-endian uint16, a vocabulary of at most "
        "65,536 ids) or FILE.npy (uint16, or uint32 for larger vocabularies), the token "
        "files `run --data` reads; written whole or not at all",
    )
    parser.add_argument(
        "--model",
        type=model_name,
        required=True,
        metavar="hf:DIR",
        help="the model whose tokenizer to use: DIR/tokenizer.json (a Hugging Face "
        "checkpoint directory, as --model hf:DIR of `run`), read offline by the tokenizers "
        "library; the text's ids as one stream, no special tokens added",
    )


def run(args: argparse.Namespace) -> int:
    from pipelang.backends.hf_tokenize import (
        TokenizeError,
        extra_problem,
        output_problem,
        tokenize,
    )
    from pipelang.progress import console, work_progress

    if not args.model.startswith("hf:"):
        raise UsageError(
            f"--model {quote(args.model)}: tokenize reads a checkpoint's tokenizer: give hf:DIR"
        )
    problem = extra_problem() or output_problem(args.out)
    if problem is not None:
        raise UsageError(problem)
    writable(args.out)
    directory = args.model.removeprefix("hf:")
    err = console(stderr=True)
    try:
        with work_progress(err) as update:
            done = tokenize(
                args.text,
                Path(directory),
                args.out,
                lambda read, total, ids: update("tokenize", read, total, f"{ids:,} tokens"),
            )
    except TokenizeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(
        f"wrote {done.tokens:,} tokens ({done.dtype}, a vocabulary of {done.vocab:,}) to "
        f"{args.out}: pipelang run ... --model {args.model} --data {args.out}"
    )
    return 0
