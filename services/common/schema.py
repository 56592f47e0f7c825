"""Declarative schemas for the documents people edit, and their one mapping to :class:`ConfigError`.

Every configuration document (registry file, experiment JSON in Consul, a model's
``config.yaml``, the recorder's redaction rules) is validated by a pydantic model
derived from :class:`Document`: strict types (YAML's ``true`` is not 1, ``"10"`` is
not 10, ``2`` is not ``"2"``), unknown keys refused (a typo is an error, not a
silently ignored setting) and only finite floats (``.nan``/``.inf`` would poison
every comparison after them). A wrong value is then always a ``ValidationError``,
which :func:`validate` turns into a one-line ConfigError naming the field path
(``models.m.experiment.arms[1].weight: ...``), so callers need one ``except``.
"""

from __future__ import annotations

import inspect
import json
import re
import types
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, PlainValidator, ValidationError
from pydantic_core import PydanticCustomError

from splitstream.common.errors import ConfigError

D = TypeVar("D", bound="Document")


class Document(BaseModel):
    """Base of every configuration schema: strict, closed, finite, immutable."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)


def field_path(location: Sequence[int | str], prefix: str = "") -> str:
    """``("models", "m", "arms", 1, "weight")`` → ``models.m.arms[1].weight`` (after ``prefix``)."""
    path = prefix
    for part in location:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part == "[key]":  # pydantic's marker for a mapping key that failed validation
            path += " (key)"
        elif not part or not part.isprintable() or any(c.isspace() or c in ".[]" for c in part):
            path += f"[{part!r}]"  # a key that could not be read back from a dotted path, or would break the line
        else:
            path += f".{part}" if path else str(part)
    return path or "(document)"


# -- constrained types whose errors read as a rule, not as a type name ----------------------------------
#
# Pydantic's strict types say "Input should be a valid integer"; for a setting with a bound the reader
# needs the rule ("must be an integer >= 1"). Each is declared once here and used as a field type.


def _refuse(kind: str, message: str, **context: Any) -> PydanticCustomError:
    return PydanticCustomError(kind, message, context or None)


def int_at_least(minimum: int) -> Any:
    """An ``int`` (never a bool) >= ``minimum``."""

    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise _refuse("int_at_least", "must be an integer >= {minimum}", minimum=minimum)
        return value

    return Annotated[int, PlainValidator(check)]


def one_of(*choices: str) -> Any:
    """One of the given strings, exactly."""

    def check(value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise _refuse("one_of", "must be one of {choices}", choices=list(choices))
        return value

    return Annotated[str, PlainValidator(check)]


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _refuse("flag", "must be true or false")
    return value


#: ``true`` or ``false`` (YAML's ``yes``, 1 and "true" are refused).
Flag = Annotated[bool, PlainValidator(_flag)]


def _shape(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(d, int) and not isinstance(d, bool) for d in value):
        raise _refuse("shape", "must be a list of integers (-1 = dynamic)")
    return tuple(value)


#: A tensor shape: a list of integers, kept as a tuple.
Shape = Annotated[tuple[int, ...], PlainValidator(_shape)]


#: Pydantic's wording where ours reads better to someone editing a file.
_MESSAGES = {"extra_forbidden": "unknown field (a typo?)", "missing": "is required"}


def _value_text(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe(error: ValidationError, *, prefix: str = "", rename: Callable[[str], str] | None = None) -> str:
    """One readable line: the first problem with its field path and the value found, and how many more.

    ``rename`` turns the path into the name the user knows (a flag, for settings read from a command line).
    A rule across fields (a model validator) has no path: its message names the fields itself.
    """
    problems = error.errors(include_url=False)
    first = problems[0]
    bound = (first.get("ctx") or {}).get("ge" if first["type"] == "greater_than_equal" else "gt")
    if first["type"] in ("greater_than_equal", "greater_than") and bound == 0:
        message = "must not be negative" if first["type"] == "greater_than_equal" else "must be positive"
    else:
        message = _MESSAGES.get(first["type"]) or str(first["msg"]).removeprefix("Value error, ")
    location = tuple(first["loc"])
    if first["type"] == "missing" and len(location) > 1:  # "inputs[0]: lacks ['shape']" reads better
        location, message = location[:-1], f"lacks [{str(location[-1])!r}]"
    path = field_path(location, prefix) if location or prefix else ""
    if rename is not None and path:
        path = rename(path)
    line = f"{path}: {message}" if path else message
    if first["type"] not in ("missing", "extra_forbidden") and "input" in first:
        line += f", got {_value_text(first['input'])}"
    if len(problems) > 1:
        line += f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})"
    return line


def validate(
    schema: type[D], data: Any, *, where: str = "", prefix: str = "", rename: Callable[[str], str] | None = None
) -> D:
    """``schema.model_validate(data)``; any problem is a ConfigError ``"<where>: <field path>: <problem>"``."""
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        line = describe(error, prefix=prefix, rename=rename)
        raise ConfigError(f"{where}: {line}" if where else line) from None


# -- the reference (docs/configuration.md is generated from the schemas, so it cannot drift) ----------


def _nested_document(annotation: Any) -> tuple[type[Document], str] | None:
    """The Document inside ``annotation`` (through Annotated, Optional, list, dict) and the path step to it."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _nested_document(args[0])
    if origin in (Union, types.UnionType):
        found = [n for n in (_nested_document(a) for a in args) if n is not None]
        return found[0] if found else None
    if origin is list:
        inner = _nested_document(args[0])
        return (inner[0], "[]" + inner[1]) if inner else None
    if origin is dict:
        inner = _nested_document(args[1])
        return (inner[0], ".<key>" + inner[1]) if inner else None
    if isinstance(annotation, type) and issubclass(annotation, Document):
        return annotation, ""
    return None


_TYPE_NAMES = {str: "string", float: "number", int: "integer", bool: "true/false", type(None): "null"}


def type_text(annotation: Any) -> str:
    """A reader's name for a field's type: ``list of string``, ``number or null``."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return type_text(args[0])
    if origin in (Union, types.UnionType):
        return " or ".join(type_text(arg) for arg in args)
    if origin is list:
        return f"list of {type_text(args[0])}"
    if origin is dict:
        return f"map of {type_text(args[0])} to {type_text(args[1])}"
    if origin is Literal:
        return " / ".join(f"`{arg}`" for arg in args)
    if origin is tuple:  # written as a YAML list, kept as a tuple
        return f"list of {type_text(args[0])}"
    if annotation in _TYPE_NAMES:
        return _TYPE_NAMES[annotation]
    return "mapping"  # a Document, or a value type built from one (e.g. a tensor spec)


def _field_comments(schema: type[Document]) -> dict[str, str]:
    """The ``#:`` comments above each field in the class body (Sphinx's convention), for fields without a
    ``description``: one text serves the code reader and the generated reference."""
    try:
        lines = inspect.getsource(schema).splitlines()
    except (OSError, TypeError):
        return {}
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in lines:
        text = line.strip()
        if text.startswith("#:"):
            pending.append(text[2:].strip())
            continue
        name, sep, _ = text.partition(":")
        if sep and name.isidentifier() and pending:
            comments[name] = " ".join(pending)
        pending = []
    return comments


def reference_rows(schema: type[Document], prefix: str = "") -> list[tuple[str, str, str, str]]:
    """``(field path, type, default, meaning)`` for every field of ``schema`` and the documents inside it."""
    rows = []
    comments = _field_comments(schema)
    for name, info in schema.model_fields.items():
        path = f"{prefix}{name}"
        if info.is_required():
            default = "required"
        else:
            value = info.get_default(call_default_factory=True)
            if isinstance(value, BaseModel):
                value = value.model_dump(mode="json", exclude_defaults=True)
            default = "null" if value is None else f"`{json.dumps(value)}`"
        meaning = info.description or comments.get(name, "")
        meaning = re.sub(r":\w+:`", "`", " ".join(meaning.split()).replace("``", "`"))  # Sphinx roles → code
        rows.append((path, type_text(info.annotation), default, meaning))
        nested = _nested_document(info.annotation)
        if nested is not None:
            rows += reference_rows(nested[0], prefix=f"{path}{nested[1]}.")
    return rows
