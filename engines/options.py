"""Command-line options generated from the pydantic config classes, so each default and its help live
in one place: the field (torchtitan does this with tyro; this is the small version of it).

    parser = argparse.ArgumentParser()
    add_config_options(parser, GatewayConfig, skip={"engines"}, sections={"limits": "limits"})
    config = build_config(GatewayConfig, parser.parse_args(), layers=[env_defaults])

One option per scalar field, named --kebab-name (a field of a section, a nested config, keeps its own
name: limits.max_prompt_tokens is --max-prompt-tokens). The type comes from the annotation: int, float
and str take a value, ``X | None`` takes an X, a Literal gives the choices, a bool is --name /
--no-name. The help is the field's description with its default. An option that is not given stays
out of the namespace (argparse.SUPPRESS), so the config class's default applies, or a layer under the
command line: an environment default, a --config JSON file. Values are checked by the config class
itself (pydantic): a bad one is reported under its option's name.

Both sides of a process boundary use this: `python -m engines.gateway` and `gyre gateway` build the
same parser from GatewayConfig; a parent process hands a child its whole config as JSON (--config -,
on stdin) instead of rebuilding argv.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

SCALARS = (int, float, str)
M = TypeVar("M", bound=BaseModel)


def add_config_options(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    *,
    skip: Iterable[str] = (),
    sections: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
    default_text: Mapping[str, str] | None = None,
) -> None:
    """Adds one option per scalar field of ``model`` and of its ``sections`` (field name -> group title).

    ``skip``: dotted field names left out (a secret no command line should carry, a list the caller
    parses itself). ``env``: dotted field name -> the environment variable that gives its default
    (named in the help; the settings module reads it). ``default_text``: dotted field name -> what the
    help says instead of the class's default (a default computed at run time)."""
    skip, sections = set(skip), dict(sections or {})
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        if name in sections:
            section = field.annotation
            if not (isinstance(section, type) and issubclass(section, BaseModel)):
                raise TypeError(f"{model.__name__}.{name} is not a config section (a pydantic model)")
            group = parser.add_argument_group(sections[name], section.__doc__)
            for inner, inner_field in section.model_fields.items():
                dotted = f"{name}.{inner}"
                if dotted not in skip:
                    _add_option(group, dotted, inner_field, section, env or {}, default_text or {})
            continue
        _add_option(parser, name, field, model, env or {}, default_text or {})


def add_config_file_option(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """--config FILE: the whole config as JSON (``model.model_dump_json()``); '-' reads it from stdin,
    where a parent process puts it (secrets included: they stay out of argv and off the disk)."""
    parser.add_argument(
        "--config",
        dest="config_file",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help=f"the whole {model.__name__} as JSON ('-': read it from stdin); options given beside it override it (default: none)",
    )


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The config options given on the command line, nested by section: {"port": 1, "limits": {...}}."""
    nested: dict[str, Any] = {}
    for dest, value in vars(args).items():
        if not dest.startswith("config."):
            continue
        *sections, name = dest.removeprefix("config.").split(".")
        target = nested
        for section in sections:
            target = target.setdefault(section, {})
        target[name] = value
    return nested


def build_config(model: type[M], args: argparse.Namespace, *, layers: Iterable[Mapping[str, Any]] = ()) -> M:
    """The config from, lowest first: the class's defaults, each of ``layers`` (environment defaults),
    the --config file, the options given. A value the class refuses raises ValueError naming the option."""
    values: dict[str, Any] = {}
    for layer in layers:
        values = merge(values, layer)
    config_file = getattr(args, "config_file", None)
    if config_file is not None:
        values = merge(values, read_config_file(config_file))
    values = merge(values, given_options(args))
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        problems = "; ".join(
            f"{option_name('.'.join(str(p) for p in error['loc']))}: {error['msg']}" for error in exc.errors()
        )
        raise ValueError(f"invalid {model.__name__}: {problems}") from None


def parse_config(
    parser: argparse.ArgumentParser,
    to_config: Callable[[argparse.Namespace], M],
    argv: Sequence[str] | None = None,
) -> M:
    """A server's main: its argv parsed into its config, or exit 2 with the refused option named."""
    try:
        return to_config(parser.parse_args(argv))
    except ValueError as exc:
        parser.error(str(exc))


def read_config_file(path: str) -> dict[str, Any]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config {path} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} holds {type(data).__name__}, not a JSON object")
    return data


def merge(low: Mapping[str, Any], high: Mapping[str, Any]) -> dict[str, Any]:
    """``high`` over ``low``; sections (dicts on both sides) merge field by field."""
    out = dict(low)
    for key, value in high.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def option_name(dotted: str) -> str:
    """The option of a dotted field name: limits.max_prompt_tokens -> --max-prompt-tokens."""
    return "--" + dotted.rsplit(".", 1)[-1].replace("_", "-")


def _add_option(target, dotted: str, field, model: type[BaseModel], env, default_text) -> None:
    kind, choices = _option_type(field.annotation, f"{model.__name__}.{dotted.rsplit('.', 1)[-1]}")
    help_text = (field.description or "").rstrip(".")
    required = field.default is PydanticUndefined and field.default_factory is None
    if dotted in default_text:
        default = default_text[dotted]
    else:
        default = "" if required else _shown(field.get_default(call_default_factory=True))
    if dotted in env:
        default = f"${env[dotted]}, else {default}"
    if required:
        help_text = f"{help_text} (required: here or in --config)"
    elif "(default" not in help_text:  # a description may already say where its default comes from
        help_text = f"{help_text} (default: {default})" if help_text else f"default: {default}"
    common = {"dest": f"config.{dotted}", "default": argparse.SUPPRESS, "help": help_text.replace("%", "%%")}
    if kind is bool:
        target.add_argument(option_name(dotted), action=argparse.BooleanOptionalAction, **common)
        return
    metavar = None if choices else dotted.rsplit(".", 1)[-1].upper()
    target.add_argument(option_name(dotted), type=kind, choices=choices, metavar=metavar, **common)


def _option_type(annotation: Any, where: str) -> tuple[type, list[Any] | None]:
    """(the argparse type, the choices or None) of a field's annotation."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(options) == 1:
            return _option_type(options[0], where)
    if typing.get_origin(annotation) is Literal:
        values = list(typing.get_args(annotation))
        return type(values[0]), values
    if annotation is bool or annotation in SCALARS:
        return annotation, None
    raise TypeError(f"{where}: no command-line option for a field of type {annotation!r}; skip it")


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)
