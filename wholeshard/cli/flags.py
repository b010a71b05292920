"""Command-line flags made from config dataclasses: one flag per field, help from its docstring.

A field's flag is `--field-name`, or `metadata["flag"]` where a section names it otherwise
(`ModelConfig.name` is `--model`). Its type, choices and default come from the field: `int`,
`float`, `str`, a `Literal[...]` (choices), each optionally `| None`; `bool` becomes a switch
(`--x`, or `--x/--no-x` when on by default or None). Fields of other types (callables, dtypes)
get no flag. Docstrings are read from the source with `ast`, so help needs no import of what
the annotations name (torch).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

from ..train.jobfile import field_type

MISSING = argparse.SUPPRESS
"""The default of a flag that overrides only when given (`add_flags(..., overrides=True)`)."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string under it in the class body) on one line; empty where
    the source cannot be read (a frozen application)."""
    try:
        body = ast.parse(inspect.getsource(cls)).body[0].body  # type: ignore[attr-defined]
    except (OSError, TypeError):
        return {}
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def flag_name(field: dataclasses.Field) -> str:
    """`--batch-size` for `batch_size`, or the field's own `metadata["flag"]`."""
    return "--" + field.metadata.get("flag", field.name.replace("_", "-"))


def field_kind(cls: type, field: dataclasses.Field) -> tuple[type, tuple[Any, ...] | None] | None:
    """(`bool`, `int`, `float` or `str`; the choices of a `Literal`, else None) of a field, or
    None when it has no flag (`wholeshard.train.jobfile.field_type`: the job file's rule);
    `int | Literal[...]` parses as an int or one of its words."""
    kind = field_type(cls, field)
    if kind is not None and kind[0] is int and kind[1] is not None:  # `int | Literal["auto"]`
        return _int_or(kind[1]), None
    return kind


def add_flags(
    group: Any,
    cls: type,
    *,
    dest: str = "",
    skip: frozenset[str] = frozenset(),
    overrides: bool = False,
    metavars: dict[str, str] | None = None,
) -> list[tuple[str, str]]:
    """Add a flag for every field of dataclass `cls` (except `skip`) to `group`; returns
    (field, dest) pairs. `dest` prefixes the argparse destinations (`"parallel."`). With
    `overrides`, a flag not given leaves its field alone (no default): bool flags are
    `--x/--no-x`."""
    docs = field_docs(cls)
    added = []
    for f in dataclasses.fields(cls):
        kind = None if f.name in skip else field_kind(cls, f)
        if kind is None:
            continue
        python_type, choices = kind
        kwargs: dict[str, Any] = dict(
            dest=dest + f.name,
            help=docs.get(f.name, "").replace("%", "%%"),
            default=MISSING if overrides else f.default,
        )
        if python_type is bool:
            off_by_default = f.default is False and not overrides
            kwargs["action"] = "store_true" if off_by_default else argparse.BooleanOptionalAction
        else:
            upper = f.metadata.get("flag", f.name).replace("-", "_").upper()
            metavar = None if choices else (metavars or {}).get(f.name, upper)
            kwargs.update(type=python_type, choices=choices, metavar=metavar)
        group.add_argument(flag_name(f), **kwargs)
        added.append((f.name, dest + f.name))
    return added


def _int_or(words: tuple[Any, ...]) -> Callable[[str], Any]:
    """An argparse type: an int, or one of `words`."""

    def parse(text: str) -> Any:
        if text in words:
            return text
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer or one of {', '.join(map(str, words))}, got {text!r}"
            ) from None

    parse.__name__ = "int or " + "/".join(map(str, words))
    return parse
