"""MkDocs hook: the configuration reference, generated from the code at every build.

    mkdocs build --strict          # mkdocs.yml lists this file under `hooks:`

`on_files` adds two files that are not in docs/:

- `reference/configuration.md`: every key of a campaign's TOML config, one table per section
  (key, type, default, description), made by walking `flows.config.CampaignConfig` and nothing
  else: nested pydantic models through `model_fields`, nested dataclasses through
  `dataclasses.fields`. A description is the field's `description=` or, where it has none, the
  docstring written under the field (the dataclass habit). A section's intro is its class
  docstring. Where each class lives is read from the class itself, so moving a config class to
  another module changes nothing here, and a new key shows up without editing the docs.
- `assets/ui.png` and `assets/mlflow.png`: the screenshots `make screenshot` writes to
  bench/results/ (the Prefect UI, the MLflow UI), copied into the site at build time so git holds
  one copy of each.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PAGE = "reference/configuration.md"
IMAGES = {
    "assets/ui.png": ROOT / "bench" / "results" / "ui.png",
    "assets/mlflow.png": ROOT / "bench" / "results" / "mlflow.png",
}


@dataclasses.dataclass
class Key:
    name: str
    type: str
    default: str
    description: str


@dataclasses.dataclass
class Section:
    path: tuple[str, ...]  # () is the top level, ("dispatch", "harness") is [dispatch.harness]
    cls: type
    doc: str
    keys: list[Key]
    array: bool = False  # a list of tables: [[cluster.hosts]]

    @property
    def title(self) -> str:
        if not self.path:
            return "Top level"
        return f"[[{'.'.join(self.path)}]]" if self.array else f"[{'.'.join(self.path)}]"

    @property
    def anchor(self) -> str:
        return "-".join(self.path) if self.path else "top-level"


def campaign_config() -> type:
    """`flows.config.CampaignConfig` from this checkout (not from wherever the package is installed)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from flows.config import CampaignConfig

    return CampaignConfig


def _is_model(tp: Any) -> bool:
    from pydantic import BaseModel

    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _is_section(tp: Any) -> bool:
    return _is_model(tp) or (isinstance(tp, type) and dataclasses.is_dataclass(tp))


def _section_class(annotation: Any) -> type | None:
    """The config class a field holds (also through `X | None`), or None for a plain value."""
    if _is_section(annotation):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        classes = [arg for arg in typing.get_args(annotation) if _is_section(arg)]
        if len(classes) == 1:
            return classes[0]
    return None


def _field_docstrings(cls: type) -> dict[str, str]:
    """The string literal under each annotated field of `cls` and its bases (PEP 257 attribute docstrings)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(inspect.getsource(klass).lstrip())
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, after in zip(body, [*body[1:], None], strict=True):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _class_doc(cls: type) -> str:
    doc = cls.__dict__.get("__doc__") or ""
    if dataclasses.is_dataclass(cls) and doc.startswith(f"{cls.__name__}("):
        return ""  # the signature dataclasses write when a class has no docstring
    return inspect.cleandoc(doc)


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "None"
    if isinstance(tp, str):
        return tp
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Literal:
        return " | ".join(json.dumps(arg) for arg in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(arg) for arg in args)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(arg) for arg in args)}]" if args else name
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "length >=", "max_length": "length <="}


def _constraints(metadata: list[Any]) -> str:
    parts = []
    for item in metadata:
        for attr, sign in _BOUNDS.items():
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{sign} {value}")
    return ", ".join(parts)


REQUIRED = object()
"""The default of a key that has none: the config must give it."""


def _toml(value: Any) -> str:
    """A default as it would be written in the TOML file."""
    if value is REQUIRED:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    if isinstance(value, dict):
        return (
            "{ " + ", ".join(f"{key} = {_toml(item)}" for key, item in value.items()) + " }"
            if value
            else "{}"
        )
    if hasattr(value, "value"):  # an Enum
        return _toml(value.value)
    return repr(value)


def _fields(cls: type) -> Iterator[tuple[str, Any, Any, str, str]]:
    """(name, annotation, default, description, constraints) of each field of a pydantic model or dataclass."""
    under = _field_docstrings(cls)
    if _is_model(cls):
        for name, info in cls.model_fields.items():
            default = REQUIRED if info.is_required() else info.get_default(call_default_factory=True)
            yield (
                name,
                info.annotation,
                default,
                info.description or under.get(name, ""),
                _constraints(info.metadata),
            )
    else:
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if field.default is not dataclasses.MISSING:
                default = field.default
            elif field.default_factory is not dataclasses.MISSING:
                default = field.default_factory()
            else:
                default = None
            help_text = field.metadata.get("help") or field.metadata.get("doc") or under.get(field.name, "")
            yield field.name, hints.get(field.name, field.type), default, help_text, ""


def _table_list_class(annotation: Any) -> type | None:
    """The config class of a list of tables (``list[HostSpec]``), else None."""
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation) or (None,)
        if item is not None and _is_section(item):
            return item
    return None


def sections(cls: type, path: tuple[str, ...] = (), array: bool = False) -> list[Section]:
    """`cls`'s section, then every nested section depth first, in field order."""
    own = Section(path=path, cls=cls, doc=_class_doc(cls), keys=[], array=array)
    nested: list[Section] = []
    for name, annotation, default, description, constraints in _fields(cls):
        inner = _section_class(annotation)
        items = _table_list_class(annotation)
        if inner is not None or items is not None:
            child = (*path, name)
            nested.extend(sections(inner or items, child, array=items is not None))
            kind = (
                f"section [{'.'.join(child)}]" if items is None else f"list of tables [[{'.'.join(child)}]]"
            )
            if items is not None and constraints:
                kind += f" ({constraints})"
            link = f"[see below](#{'-'.join(child)})"
            own.keys.append(
                Key(name, kind, link if default is not REQUIRED else f"required; {link}", description)
            )
            continue
        type_text = _type_name(annotation) + (f" ({constraints})" if constraints else "")
        own.keys.append(Key(name, type_text, _toml(default), description))
    return [own, *nested]


def _cell(text: str) -> str:
    """Prose for one table cell: one line; outside `code spans`, pipes and angle brackets escaped."""
    parts = " ".join(text.split()).split("`")
    for i in range(0, len(parts), 2):  # the even parts are outside code spans
        parts[i] = parts[i].replace("|", "\\|").replace("<", "&lt;")
    return "`".join(parts)


def _prose(doc: str) -> str:
    """A docstring as Markdown: `<name>` outside code spans and indented code is text, not an HTML tag."""
    lines = []
    for line in doc.splitlines():
        if not line.startswith("    "):
            parts = line.split("`")
            parts[::2] = [part.replace("<", "&lt;") for part in parts[::2]]
            line = "`".join(parts)
        lines.append(line)
    return "\n".join(lines)


def _code(text: str) -> str:
    """A value as a code span (a pipe inside one does not split the table's cell)."""
    text = " ".join(text.split())
    return f"``{text}``" if "`" in text else f"`{text}`" if text else ""


def render(root: type | None = None) -> str:
    """The whole reference page, as Markdown."""
    root = root or campaign_config()
    all_sections = sections(root)
    module_doc = inspect.cleandoc(sys.modules[root.__module__].__doc__ or "")
    lines = [
        "# Configuration reference",
        "",
        "Every key a campaign config (TOML) can set, with its type, default and meaning. This page is",
        f"generated at each docs build from `{root.__name__}` itself (`docs/hooks/config_reference.py`",
        "walks its fields and the sections nested in them), so it lists exactly what the code accepts.",
        "`configs/demo.toml` is the config `gyre run` uses; `gyre run --config FILE` takes another.",
        "A key left out takes the default shown here. A key that no section knows is refused, with",
        "where it is and the nearest valid name (a `step = 3` beside `steps = 8` fails to load:",
        "`unknown key 'step' in the top level of the campaign config; did you mean 'steps'?`).",
        "",
        "```python",
        f"from {root.__module__} import {root.__name__}",
        "",
        f'config = {root.__name__}.from_toml("configs/demo.toml")',
        "```",
        "",
        "Sections: " + ", ".join(f"[{s.title}](#{s.anchor})" for s in all_sections) + ".",
        "",
    ]
    for section in all_sections:
        lines += [f"## {section.title} {{#{section.anchor}}}", ""]
        doc = section.doc or (module_doc if section.cls is root else "")
        if doc:
            lines += [_prose(doc), ""]
        where = f"{section.cls.__module__.replace('.', '/')}.py"
        lines += [f"Class `{section.cls.__name__}` in `{where}`.", ""]
        lines += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
        for key in section.keys:
            default = key.default if "[see below]" in key.default else _code(key.default)
            lines.append(f"| `{key.name}` | {_code(key.type)} | {default} | {_cell(key.description)} |")
        lines.append("")
    return "\n".join(lines)


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    for uri, source in IMAGES.items():
        files.append(File.generated(config, uri, abs_src_path=str(source)))
    return files
