"""The configuration reference rows of a schema: docs/configuration.md is generated from them, so it cannot drift.

Each field's meaning is its ``description``, else the ``#:`` comment above it in the class body
(Sphinx's convention), so one text serves the code reader and the reference.
"""

from __future__ import annotations

import inspect
import json
import re
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

from splitstream.common.schema import Document


def _nested_document(annotation: Any) -> tuple[type[Document], str] | None:
    """The Document inside ``annotation`` (through Annotated, Optional, list, dict) and the path step to it."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _nested_document(args[0])
    if origin in (Union, types.UnionType):
        found = [n for n in (_nested_document(a) for a in args) if n is not None]
        return found[0] if found else None
    if origin in (list, tuple):
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
