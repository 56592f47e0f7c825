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

from collections.abc import Callable, Sequence
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, PlainValidator, ValidationError
from pydantic_core import PydanticCustomError

from splitstream.common.errors import ConfigError
from splitstream.common.secrets import redact_text

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


def int_at_least(minimum: int, maximum: int | None = None) -> Any:
    """An ``int`` (never a bool) >= ``minimum`` (and <= ``maximum`` when given)."""

    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            if maximum is not None:
                raise _refuse(
                    "int_within", "must be an integer within {minimum}..{maximum}", minimum=minimum, maximum=maximum
                )
            raise _refuse("int_at_least", "must be an integer >= {minimum}", minimum=minimum)
        if maximum is not None and value > maximum:
            raise _refuse(
                "int_within", "must be an integer within {minimum}..{maximum}", minimum=minimum, maximum=maximum
            )
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
    text = redact_text(repr(value))  # a URL's password (``http://user:pw@host``) is never quoted
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
    # A rule across fields has no path and its input is the whole document, which may hold secrets
    # (a recorder's Redis URL with its password); its message names the fields itself.
    if location and first["type"] not in ("missing", "extra_forbidden") and "input" in first:
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
