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

from collections.abc import Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

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
        else:
            path += f".{part}" if path else str(part)
    return path or "(document)"


#: Pydantic's wording where ours reads better to someone editing a file.
_MESSAGES = {"extra_forbidden": "unknown field (a typo?)", "missing": "is required"}


def _value_text(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe(error: ValidationError, *, prefix: str = "") -> str:
    """One readable line: the first problem with its field path and the value found, and how many more."""
    problems = error.errors(include_url=False)
    first = problems[0]
    message = _MESSAGES.get(first["type"]) or str(first["msg"]).removeprefix("Value error, ")
    line = f"{field_path(first['loc'], prefix)}: {message}"
    if first["type"] not in ("missing", "extra_forbidden") and "input" in first:
        line += f", got {_value_text(first['input'])}"
    if len(problems) > 1:
        line += f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})"
    return line


def validate(schema: type[D], data: Any, *, where: str = "", prefix: str = "") -> D:
    """``schema.model_validate(data)``; any problem is a ConfigError ``"<where>: <field path>: <problem>"``."""
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        line = describe(error, prefix=prefix)
        raise ConfigError(f"{where}: {line}" if where else line) from None
