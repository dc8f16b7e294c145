"""Click options made from a config dataclass, and `--config FILE.toml` for the same keys.

Each field of a config (runtime/run_config.py, builder/spec/build_config.py) is one option: its
name with dashes (or the field's `flag`), its type from the annotation and the field's
`check` (runtime/common/config_fields.py), its help from the docstring under the field. A TOML file
sets the same keys, in the command's section ([run] or [build]; one job.toml can hold both),
and a flag given on the command line wins over the file. Values from the file go through the
same click types as flags, so a bad one is the same one-line error, naming the file and key.
"""

from __future__ import annotations

import ast
import inspect
import types
import typing
from dataclasses import MISSING, fields
from functools import cache
from pathlib import Path

import click
from click.core import ParameterSource

from titan.cli.options import (LEARNING_RATE, NON_NEGATIVE, POSITIVE, SEED, TIMEOUT, FiniteFloat, NonEmptyPath)

CONFIG_OPTION = "config"
MAX_CONFIG_BYTES = 1 << 20

_TYPES = {
    "positive": POSITIVE, "non_negative": NON_NEGATIVE, "seed": SEED, "positive_float": LEARNING_RATE,
    "non_negative_float": FiniteFloat(0.0, inclusive=True), "timeout": TIMEOUT,
    "fraction": FiniteFloat(0.0, inclusive=True, maximum=1.0), "seq_len": click.IntRange(min=2),
    "file": NonEmptyPath(dir_okay=False), "dir": NonEmptyPath(file_okay=False),
    "path": NonEmptyPath(path_type=Path),
}


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (the convention torchtitan's configs use)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _base_type(annotation):
    """(the type without `| None`, whether None is allowed)."""
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        rest = [a for a in args if a is not type(None)]
        assert len(rest) == 1, annotation
        return rest[0], True
    return annotation, False


def _option(cls: type, f, hint, default):
    meta = f.metadata
    flag = meta.get("flag") or "--" + f.name.replace("_", "-")
    help_text = field_docs(cls).get(f.name, "")
    base, _ = _base_type(hint)
    if base is bool:
        if default:
            return click.option(f"{flag}/--no-{flag[2:]}", f.name, default=True, show_default=True, help=help_text)
        return click.option(flag, f.name, is_flag=True, default=False, help=help_text)
    if typing.get_origin(base) is typing.Literal:
        kind = click.Choice([str(a) for a in typing.get_args(base)])
    elif meta.get("check"):
        kind = _TYPES[meta["check"]]
    else:
        kind = {int: int, float: float, str: str}[base]
    extra = {}
    if meta.get("flag_value") is not None:
        extra = dict(is_flag=False, flag_value=meta["flag_value"])
    return click.option(flag, f.name, default=default, type=kind, show_default=default is not None,
                        help=help_text, **extra)


def config_options(cls: type, *, section: str, only: tuple[str, ...] | None = None,
                   defaults: dict | None = None):
    """Decorate a click command with one option per field of `cls` (those in `only`, if given;
    `defaults` overriding the dataclass's) and --config."""
    hints = typing.get_type_hints(cls)
    chosen = [f for f in fields(cls) if f.metadata.get("cli", True) and (only is None or f.name in only)]

    def decorate(command):
        for f in reversed(chosen):
            default = (defaults or {}).get(f.name, f.default if f.default is not MISSING else None)
            command = _option(cls, f, hints[f.name], default)(command)
        return click.option(f"--{CONFIG_OPTION}", default=None, type=NonEmptyPath(dir_okay=False),
                            help=f"TOML file whose [{section}] table sets any of these options by their key "
                                 "(dashes as underscores); flags given here win.")(command)
    return decorate


def resolve(cls: type, values: dict, *, section: str, **fixed):
    """The config from a command's parsed values: the --config file's keys, then the flags the
    user gave (click's context says which came from the command line)."""
    ctx = click.get_current_context()
    path = values.pop(CONFIG_OPTION, None)
    if path is not None:
        params = {p.name: p for p in ctx.command.params}
        for key, raw in read_section(path, section, allowed=[f.name for f in fields(cls)]).items():
            if key not in values:
                continue  # a key of the job that this command does not take (titan-verify has no --metrics)
            if ctx.get_parameter_source(key) not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP):
                continue  # the command line wins
            values[key] = _convert(params[key], raw, ctx, where=f"{path}: [{section}] {key}")
    return cls(**values, **fixed)


def read_section(path: str, section: str, *, allowed: list[str]) -> dict:
    """The [section] table of a TOML config file, its keys checked against `allowed`."""
    from titan.runtime.common.safe_files import read_user_file
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ValueError("--config needs Python 3.11 or later (tomllib), or `pip install tomli`") from None
    text = read_user_file(Path(path), max_size=MAX_CONFIG_BYTES, what=f"--config {path}")
    try:
        doc = tomllib.loads(text.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {path} is not TOML ({e}); see docs/configs/ for examples") from None
    table = doc.get(section, {})
    if not isinstance(table, dict):
        raise ValueError(f"--config {path}: [{section}] must be a table of keys")
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise ValueError(f"--config {path}: [{section}] has no key {', '.join(map(repr, unknown))}; "
                         f"the keys are: {', '.join(allowed)}")
    return table


def _convert(param: click.Parameter, raw, ctx, *, where: str):
    if isinstance(param, click.Option) and param.is_bool_flag:
        if not isinstance(raw, bool):
            raise ValueError(f"{where} must be true or false, not {raw!r}")
        return raw
    if isinstance(raw, (dict, list)):
        raise ValueError(f"{where} must be a single value, not {raw!r}")
    try:
        return param.type.convert(raw, param, ctx)
    except click.BadParameter as e:
        raise ValueError(f"{where}: {e.format_message()}") from None
