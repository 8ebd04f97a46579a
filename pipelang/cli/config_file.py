"""`pipelang run --config FILE.toml`: a run's options from a TOML file, and the file a run
writes of its own (`effective_config`) so that it can be run again.

Every option of `pipelang run` is a key, named as its long flag without the dashes
(`micro-batch-size = 8`, or `micro_batch_size`); the schedule is `schedule = "1f1b"` and
its parameters a `[params]` table (`D = 4`). A flag is `true` or `false`. Each value is
read by the same reader as the command line's text, so it is checked the same way, and a
key the command does not have, or a value it refuses, is one usage error naming the
file's line. Options given on the command line override the file's.
"""

from __future__ import annotations

import argparse
import os
import re
import tomllib
from pathlib import Path
from typing import Any

from pipelang import __version__
from pipelang.cli.args import UsageError, parse_params
from pipelang.diagnostics import clip

MAX_CONFIG_BYTES = 1 << 20
"""The largest config file read (a real one is a few hundred bytes)."""

SCHEDULE, PARAMS = "schedule", "params"
NOT_READ = ("help", "debug", "config", "params")
"""Options that are no key (`params` is the [params] table)."""
NOT_WRITTEN = ("resume",)
"""What the written config leaves out: `resume` would make the run it describes start
from another one's checkpoint instead of running again."""


def read_config(path: Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The options `path` gives, by the `parser`'s destination names, read and checked
    as the command line's are; UsageError (with the file's line) for a bad file."""
    text = _text(path)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise UsageError(f"--config {path}: not TOML: {err}") from None
    except RecursionError:
        raise UsageError(f"--config {path}: nested too deeply to be a config") from None
    options = _options(parser)
    values: dict[str, Any] = {}
    for key, value in doc.items():
        where = f"{path}:{_line(text, key)}"
        if key == PARAMS:
            values["params"] = _params(value, where)
            continue
        name = SCHEDULE if key == SCHEDULE else key.replace("_", "-")
        action = options.get(name)
        if action is None:
            raise UsageError(
                f"{where}: unknown key `{clip(key, longest=60)}`: the keys are the options "
                "of `pipelang run` (see its --help) without their dashes, `schedule` and "
                "a [params] table"
            )
        values[action.dest] = _value(action, value, f"{where}: `{name}`")
    return values


def effective_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """The TOML of the options `args` holds (defaults included), which `read_config` reads
    back to the same values: the run again, `--config` in place of its command line."""
    lines = [
        f"# pipelang {__version__}: the options of `pipelang run` for this run. Run it again",
        "# with `pipelang run --config THIS_FILE`; options on the command line override it.",
    ]
    params = parse_params(getattr(args, "params", []))
    for name, action in _options(parser).items():
        value = getattr(args, action.dest, None)
        if value is None or value is False or action.dest in NOT_WRITTEN:
            continue
        lines.append(f"{name} = {_toml(value)}")
    if params:
        lines += ["", f"[{PARAMS}]"]
        for key, value in params.items():  # a TOML integer where it is one, else a string
            bare = re.fullmatch("-?(0|[1-9][0-9]{0,17})", value)
            lines.append(f"{_key(key)} = {value if bare else _toml(value)}")
    return "\n".join(lines) + "\n"


def write_effective_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """`DIR/config.toml` beside the checkpoints `--save DIR` writes (once, by the first
    process under torchrun), replacing the file of an earlier run there."""
    if args.save is None or os.environ.get("RANK", "0") != "0":
        return
    target = Path(args.save) / "config.toml"
    partial = target.with_name(f".config.toml.{os.getpid()}")
    try:
        partial.write_text(effective_config(args, parser))
        partial.replace(target)
    except OSError as err:
        raise UsageError(f"--save: cannot write `{target}`: {err.strerror}") from None


# ---- reading --------------------------------------------------------------------------------


def _text(path: Path) -> str:
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise UsageError(
                f"--config {path}: {size:,} bytes; a config is at most {MAX_CONFIG_BYTES:,}"
            )
        return path.read_bytes().decode("utf-8-sig")  # a byte-order mark, as some editors write
    except OSError as err:
        raise UsageError(f"--config {path}: cannot read it: {err.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"--config {path}: not UTF-8 text") from None


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's options by config key: the long flag without dashes (`schedule` for
    the positional SCHED), but those that are no key (`NOT_READ`)."""
    options: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if action.dest in NOT_READ:
            continue
        long = [s for s in action.option_strings if s.startswith("--")]
        if long:
            options[long[0][2:]] = action
        elif not action.option_strings:
            options[SCHEDULE] = action
    return options


def _value(action: argparse.Action, value: object, where: str) -> Any:
    """A config value as the option's reader reads its text on the command line."""
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise UsageError(f"{where} is a flag: give true or false, not {_shown(value)}")
        return value
    if isinstance(value, list) and all(_scalar(v) for v in value):
        text = ",".join(str(v) for v in value)
    elif _scalar(value):
        text = value if isinstance(value, str) else repr(value)
    else:
        raise UsageError(f"{where}: expected a value, not {_shown(value)}")
    try:
        read = action.type(text) if callable(action.type) else text
    except (argparse.ArgumentTypeError, ValueError, UsageError) as err:
        raise UsageError(f"{where}: {clip(str(err))}") from None
    if action.choices is not None and read not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise UsageError(f"{where}: {clip(repr(read))} is not one of {choices}")
    return read


def _scalar(value: object) -> bool:
    return isinstance(value, str | int | float) and not isinstance(value, bool)


def _params(value: object, where: str) -> list[str]:
    """The [params] table as `-p NAME=VALUE` strings."""
    if not isinstance(value, dict) or not all(_scalar(v) for v in value.values()):
        raise UsageError(f"{where}: [params] is a table of NAME = VALUE (numbers or strings)")
    return [f"{name}={v}" for name, v in value.items()]


def _line(text: str, key: str) -> int | str:
    """The line where `key` (or the [params] table) is set: the first that sets it."""
    name = re.escape(key)
    pattern = rf"\s*(\[\s*{name}\s*\]|\"?{name}\"?\s*=)"
    for number, line in enumerate(text.splitlines(), 1):
        if re.match(pattern, line):
            return number
    return "?"


def _shown(value: object) -> str:
    kind = {bool: "true/false", dict: "a table", list: "an array"}.get(type(value))
    return kind or clip(repr(value), longest=60)


# ---- writing --------------------------------------------------------------------------------


def _toml(value: object) -> str:
    """`value` as a TOML value: strings (and paths) quoted, numbers, arrays of them."""
    if value is True:
        return "true"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return _string(str(value))


def _string(text: str) -> str:
    """A TOML basic string: backslash, quote and control characters escaped."""
    escaped = []
    for char in text:
        if char in '"\\':
            escaped.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            escaped.append(f"\\u{ord(char):04x}")
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'


def _key(name: str) -> str:
    return name if re.fullmatch("[A-Za-z0-9_-]+", name) else _string(name)
