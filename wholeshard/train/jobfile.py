"""Job files: a `TrainConfig` as TOML (`wholeshard train --config job.toml`, `--print-config`).

The file's tables are `TrainConfig`'s sections (`[model]`, `[data]`, `[optim]`, `[parallel]`,
`[checkpoint]`, `[reliability]`, `[output]`), its keys their fields; `seed` and `threads` come
before any table. The keys are exactly the fields that are `wholeshard train` flags: booleans,
integers, floats, strings and their `Literal` choices (`shard_group_size`: an integer or
`"auto"`). A key left out keeps its default, and TOML has no null, so a field whose value is None
is left out (`dumps` writes it as a comment). Fields no TOML value can hold (functions, dtypes,
`timedelta`) and the `DataParallelConfig` fields the job sets itself are not keys: a file that
names one fails, saying where the value comes from instead. Relative paths are relative to the
working directory, as on the command line.

`load` reads a file into `{"data.batch_size": 64, ...}` (the argparse destinations of the
flags), checking names and types; `make_config` builds the `TrainConfig`; `dumps` writes one
back, so that `make_config(loads(dumps(cfg))) == cfg`. Reads with the standard library's
`tomllib` (`tomli` on Python 3.10); no torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
import textwrap
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine.config import ConfigError, literal_choices
from .config import PARALLEL_SET_BY_THE_JOB, SECTIONS, TrainConfig

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None

_ELSEWHERE = {
    "mp_policy": "it is set by the job from model.param_dtype (gradients reduced in float32)",
    "fp8_param_gather": "it is set by the job from model.fp8",
    "matrix_params": "it is a Python function: pass TrainConfig(...) to train() from Python",
    "param_init": "it is a Python function: pass TrainConfig(...) to train() from Python",
    "expert_params": "it is a Python function: pass TrainConfig(...) to train() from Python",
}
"""Why a field of a section is not a job-file key."""


class JobFileError(ValueError):
    """A job file that cannot be read, or a key in it that is unknown or has a wrong value;
    the message names the file and the key (`job.toml: data.batch_size: ...`)."""

    def __init__(self, source: str, key: str | None, message: str) -> None:
        super().__init__(f"{source}: {key}: {message}" if key else f"{source}: {message}")
        self.source, self.key = source, key


@dataclass(frozen=True)
class Key:
    """One job-file key: the field and the TOML values it takes."""

    path: str
    """`section.field`, or the field's name at the top level."""
    field: dataclasses.Field
    kind: type
    """bool, int, float or str."""
    choices: tuple[Any, ...] | None = None
    """The strings a `Literal` field takes (for an int field: the words it takes besides ints)."""

    def type_text(self) -> str:
        """The TOML values the key takes, as the docs and comments say them."""
        names = {bool: "true | false", int: "integer", float: "float", str: "string"}
        if self.choices is None:
            return names[self.kind]
        words = " | ".join(f'"{c}"' for c in self.choices)
        return f"integer | {words}" if self.kind is int else words


def field_type(cls: type, f: dataclasses.Field) -> tuple[type, tuple[Any, ...] | None] | None:
    """(bool, int, float or str; the strings a `Literal` takes, else None) of field `f` of
    `cls`, or None when no flag or key can hold it; `int | Literal[...]`: (int, its words). The
    one rule for job-file keys and flags (`wholeshard.cli.flags.field_kind`). Annotations are
    evaluated one field at a time, in the class's module, so an unrelated one (`torch.dtype`)
    is never evaluated."""
    hint = f.type
    if isinstance(hint, str):
        try:
            hint = eval(hint, vars(sys.modules[cls.__module__]))  # noqa: S307 (our own source)
        except NameError:  # names only a type checker imports (torch.dtype): not a key
            return None
    choices = literal_choices(hint)
    kinds = [t for t in typing.get_args(hint) or (hint,) if t is not type(None)]
    if choices is not None:
        return int if int in kinds else type(choices[0]), choices
    return (kinds[0], None) if kinds in ([bool], [int], [float], [str]) else None


def keys() -> dict[str, dict[str, Key]]:
    """Every key, by table (`""`: the top level, then `SECTIONS` in order)."""
    out = {}
    for table, cls in {"": TrainConfig, **SECTIONS}.items():
        skip = PARALLEL_SET_BY_THE_JOB if table == "parallel" else ()  # (a section has no key type)
        out[table] = {}
        for f in dataclasses.fields(cls):
            kind = None if f.name in skip else field_type(cls, f)
            if kind is not None:
                out[table][f.name] = Key(f"{table}.{f.name}" if table else f.name, f, *kind)
    return out


# -- reading ----------------------------------------------------------------------------------


def load(path: str | Path) -> dict[str, Any]:
    """The values job file `path` sets, by key path (`{"data.batch_size": 64}`); raises
    JobFileError naming the file and the key."""
    try:
        text = Path(path).read_bytes().decode()
    except OSError as e:
        raise JobFileError(str(path), None, f"cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise JobFileError(str(path), None, f"not UTF-8 text: {e}") from None
    return loads(text, str(path))


def loads(text: str, source: str = "<job file>") -> dict[str, Any]:
    """`load` of the text of a job file; `source` names it in errors."""
    if tomllib is None:
        raise JobFileError(
            source, None, "reading TOML on Python 3.10 needs tomli: pip install tomli"
        )
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise JobFileError(source, None, f"not valid TOML: {e}") from None
    known = keys()
    values: dict[str, Any] = {}
    for name, value in doc.items():
        if name in SECTIONS:
            if not isinstance(value, dict):
                raise JobFileError(
                    source, name, f"must be a table ([{name}]), got {_toml_type(value)}"
                )
            for key, item in value.items():
                values[f"{name}.{key}"] = _check(source, name, key, item, known)
        else:
            values[name] = _check(source, "", name, value, known)
    return values


def _check(source: str, table: str, name: str, value: Any, known: dict) -> Any:
    """`value`, checked against the key `table.name` (ints made floats for float keys)."""
    path = f"{table}.{name}" if table else name
    key = known[table].get(name)
    if key is None:
        raise JobFileError(source, path, _unknown(table, name, known))
    kind, ok = key.kind, False
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        ok = ok or (key.choices is not None and value in key.choices)
    else:
        ok = isinstance(value, str) and (key.choices is None or value in key.choices)
    if not ok:
        raise JobFileError(
            source, path, f"expected {key.type_text()}, got {_toml_type(value)} {_toml(value)}"
        )
    return value


def _unknown(table: str, name: str, known: dict) -> str:
    """Why `name` is not a key of `table` and what is."""
    where = f"[{table}]" if table else "the top level"
    if table:
        cls = SECTIONS[table]
        if name in {f.name for f in dataclasses.fields(cls)}:
            why = _ELSEWHERE.get(name, "no TOML value can hold it")
            return f"{name} cannot be set in a job file: {why}"
    else:
        homes = [t for t in SECTIONS if name in known[t]]
        if homes:
            return f"unknown key at the top level; {name} belongs in [{homes[0]}]"
    names = sorted(known[table]) + (sorted(SECTIONS) if not table else [])
    close = [n for n in names if n.startswith(name)] or difflib.get_close_matches(name, names, 1)
    hint = f"did you mean {close[0]}? " if close else ""
    return f"unknown key; {hint}the keys of {where} are {', '.join(names)}"


def _toml_type(value: Any) -> str:
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a float"),
                       (str, "a string"), (dict, "a table"), (list, "an array")):  # fmt: skip
        if isinstance(value, kind):
            return name
    return f"a {type(value).__name__}"  # dates and times


def make_config(values: dict[str, Any]) -> TrainConfig:
    """The TrainConfig of `values` by key path (`load`'s, or the flags' argparse destinations;
    other names are ignored); raises ConfigError naming `section.field`."""

    def fields_of(cls: type, prefix: str) -> dict[str, Any]:
        return {
            f.name: values[prefix + f.name]
            for f in dataclasses.fields(cls)
            if prefix + f.name in values
        }

    sections = {}
    for name, cls in SECTIONS.items():
        try:
            sections[name] = cls(**fields_of(cls, name + "."))
        except ConfigError as e:  # (DataParallelConfig checks itself)
            raise ConfigError(f"{name}.{e.field}", str(e)) from None
    top = {k: v for k, v in fields_of(TrainConfig, "").items() if k not in SECTIONS}
    return TrainConfig(**top, **sections)


def read(path: str | Path) -> TrainConfig:
    """The TrainConfig job file `path` describes (defaults for the keys it leaves out); raises
    JobFileError naming the file and the key."""
    values = load(path)
    try:
        return make_config(values)
    except ConfigError as e:
        raise JobFileError(str(path), e.field, str(e)) from None


# -- writing ----------------------------------------------------------------------------------


def dumps(cfg: TrainConfig, docs: Callable[[type], dict[str, str]] | None = None) -> str:
    """`cfg` as a job file: every key, in field order, a key whose value is None as a comment.
    With `docs` (`wholeshard.cli.flags.field_docs`), each key is preceded by its field's
    docstring as comments. Raises ConfigError naming a field that no key can hold with a value
    other than its default (a function, a dtype, `checkpoint.keep_last = None`)."""
    lines = ["# wholeshard train job file: wholeshard train --config FILE (flags override it)"]
    for table, table_keys in keys().items():
        obj = getattr(cfg, table) if table else cfg
        cls = SECTIONS[table] if table else TrainConfig
        _check_writable(obj, cls, table, table_keys)
        if table:
            lines += ["", f"[{table}]"]
            if docs is not None and cls.__doc__:
                lines += _comment(cls.__doc__.split("\n\n")[0])
        elif docs is not None:
            lines += _comment("Keys left out take their defaults; a key not set is None.")
        notes = docs(cls) if docs is not None else {}
        for name, key in table_keys.items():
            if docs is not None:  # (a blank line between documented keys)
                lines += ["", *_comment(notes.get(name, ""))] if notes.get(name) else [""]
            value = getattr(obj, name)
            if value is None:
                lines.append(f"# {name} = {key.type_text()}  (not set)")
            else:
                lines.append(f"{name} = {_toml(value)}")
    return "\n".join(lines) + "\n"


def _check_writable(obj: Any, cls: type, table: str, table_keys: dict[str, Key]) -> None:
    for f in dataclasses.fields(cls):
        if f.name in SECTIONS:
            continue
        value, where = getattr(obj, f.name), f"{table}.{f.name}" if table else f.name
        if f.name not in table_keys and value != f.default:
            why = _ELSEWHERE.get(f.name, "no TOML value can hold it")
            raise ConfigError(where, f"{where}={value!r} cannot be written to a job file: {why}")
        if f.name in table_keys and value is None and f.default is not None:
            raise ConfigError(
                where,
                f"{where}=None cannot be written to a job file (TOML has no null; left out, "
                f"it takes the default {f.default!r})",
            )


def _comment(text: str) -> list[str]:
    return textwrap.wrap(" ".join(text.split()), 97, initial_indent="# ", subsequent_indent="# ")


def _toml(value: Any) -> str:
    """`value` (bool, int, float or str) as a TOML value."""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # always with "." or "e": a TOML float, read back exactly
    if isinstance(value, (bool, int, str)):  # JSON writes these as TOML does, but for DEL
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    return repr(value)
