"""Pass `resolve-params`: bind the schedule's parameters, `let`s, and check `require`s.

Needs: a parsed `ast.File` and the `-p NAME=VALUE` strings from the command line.
Guarantees: every declared parameter has a value of its declared type, every
schedule-level `let` is evaluated, and every `require` holds; otherwise all of the
problems at once (E0201 missing, E0202 unknown, E0203 wrong type, E0204 failed require).

    schedule s(D: int = 4, N: int = D) { let half = N // 2  require N % 2 == 0 : "..." }
    -p N=6   =>   D = 4, N = 6, half = 3
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pipelang import ast
from pipelang.diagnostics import MAX_REPORTED, Diagnostic, PipelangError, nearest
from pipelang.evaluate import (
    BOOL,
    INT,
    MAX_DIGITS,
    Env,
    Scope,
    Value,
    compile_expr,
    infer,
    nesting_limit,
)

if TYPE_CHECKING:
    from pipelang.compiler import Compilation

_INT = re.compile(r"[+-]?[0-9]+")


def resolve_params(file: ast.File, given: Mapping[str, str]) -> dict[str, Value]:
    """Parameters, then schedule-level `let`s, in declaration order, as one environment."""
    with nesting_limit(file.schedule.span):
        return _resolve(file, given)


def _resolve(file: ast.File, given: Mapping[str, str]) -> dict[str, Value]:
    schedule = file.schedule
    problems = _unknown_params(schedule, given)
    env: Env = {}
    types: dict[str, str] = {}
    for param in schedule.params:
        if param.name in types:
            problems.append(
                Diagnostic("E0102", f"parameter `{param.name}` is declared twice", param.span)
            )
            continue
        types[param.name] = param.type
        value = _param_value(param, given, Scope(dict(types), file.fns), env)
        if isinstance(value, Diagnostic):
            problems.append(value)
        elif value is not None:
            env[param.name] = value
    if problems:
        raise PipelangError(problems)
    scope = Scope(types, file.fns)  # sees each `let` as it is declared (not a copy each)
    for decl in schedule.body:
        try:
            _declare(decl, scope, env, types, problems)
        except PipelangError:
            # A failed `require` usually explains why a later `let` cannot be evaluated
            # (say, a division by a parameter it ruled out): report the require.
            if any(p.code == "E0204" for p in problems):
                break
            raise
    if problems:
        raise PipelangError(problems)
    return env


def _declare(
    decl: ast.Decl, scope: Scope, env: Env, types: dict[str, str], problems: list[Diagnostic]
) -> None:
    """Evaluate one schedule-level `let` or `require` into `env`, or record its problem."""
    if isinstance(decl, ast.Let):
        if decl.name in types:
            problems.append(Diagnostic("E0102", f"`{decl.name}` is already defined", decl.span))
            return
        types[decl.name], value = infer(decl.value, scope)
        env[decl.name] = value(env)
    elif isinstance(decl, ast.Require) and not compile_expr(decl.test, scope, BOOL)(env):
        problems.append(_failed_require(decl, env))


def _unknown_params(schedule: ast.Schedule, given: Mapping[str, str]) -> list[Diagnostic]:
    declared = {p.name for p in schedule.params}
    names = ", ".join(f"`{p.name}`" for p in schedule.params) or "none"
    unknown = [name for name in given if name not in declared]
    return [
        Diagnostic(
            "E0202",
            f"`{schedule.name}` has no parameter `{name}`",
            schedule.span,
            notes=(f"its parameters are {names}",),
            # only the errors shown look for a spelling: thousands of names cost seconds
            help=_closest(name, [p.name for p in schedule.params]) if i < MAX_REPORTED else None,
        )
        for i, name in enumerate(unknown)
    ]


def _closest(name: str, declared: list[str]) -> str | None:
    """ "did you mean `D`?" for `-p d=4` (another case) or a near spelling."""
    close = nearest(name, declared, cutoff=0.7)
    return f"did you mean `-p {close}=...`?" if close else None


def _param_value(
    param: ast.Param, given: Mapping[str, str], scope: Scope, env: Env
) -> Value | Diagnostic | None:
    """The parameter's value; None when its default uses a parameter already reported."""
    text = given.get(param.name)
    if text is not None:
        return _parse_value(param, text.strip())
    if param.default is None:
        return Diagnostic(
            "E0201",
            f"parameter `{param.name}` needs a value",
            param.span,
            help=f"give it with `-p {param.name}=VALUE`",
        )
    without_self = Scope({k: v for k, v in scope.names.items() if k != param.name}, scope.fns)
    default = compile_expr(param.default, without_self, param.type)
    try:
        return default(env)
    except KeyError:  # an earlier parameter it uses is missing or ill-typed: said already
        return None


def _parse_value(param: ast.Param, text: str) -> Value | Diagnostic:
    if param.type == INT and _INT.fullmatch(text):
        if len(text.lstrip("+-")) > MAX_DIGITS:
            return Diagnostic(
                "E0106",
                f"`-p {param.name}=...`: an integer of "
                f"{len(text.lstrip('+-'))} digits; at most {MAX_DIGITS} are "
                "allowed",
                param.span,
            )
        return int(text)
    if param.type == BOOL and text in ("true", "false"):
        return text == "true"
    shown = text if len(text) <= 40 else text[:40] + "..."
    example = "an integer such as `8`" if param.type == INT else "`true` or `false`"
    return Diagnostic(
        "E0203",
        f"`-p {param.name}={shown}`: `{param.name}` is `{param.type}`",
        param.span,
        help=f"give {example}",
    )


def _failed_require(decl: ast.Require, env: Env) -> Diagnostic:
    shown = ", ".join(
        f"{k} = {str(v).lower() if isinstance(v, bool) else v}" for k, v in env.items()
    )
    return Diagnostic("E0204", decl.message, decl.span, notes=(f"with {shown}",))


def run(c: Compilation) -> Compilation:
    """The pass: the parameters' values, bound from `-p` and the defaults."""
    return dataclasses.replace(c, params=resolve_params(c.need_file(), c.options.params))
