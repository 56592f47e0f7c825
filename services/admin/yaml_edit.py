"""Round-trip edits of the file registry: one model's experiment changes, the rest of the text stays.

Operators keep ``registry.yaml`` in git and review its diffs, so a write changes only the lines of the
experiment fields whose value changed (a weight, the control, an arm added or dropped). Comments, blank
lines, quoting, key order and flow or block style stay as written: ruamel.yaml's round-trip mode keeps
them. Its indentation is one setting for the whole document, so it is measured from the file first (the
most common step wins when a file mixes styles); what it drops (lines before ``---``, after ``...``) is put
back from the file. A comment line is held by the line above it: dropping an arm drops the comment lines
below it, and an arm or field added at the end goes above the comment lines that closed the block.

The text written is read back with PyYAML, the way routers read it, and must hold the new experiment and
every other model unchanged; an edit that cannot be made in place (an experiment shared through a YAML
anchor, say) replaces the experiment's mapping as a whole instead.
"""

from __future__ import annotations

import io
import re
from collections import Counter
from typing import Any

import yaml
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import YAMLError as RoundTripError
from ruamel.yaml.scalarstring import DoubleQuotedScalarString, SingleQuotedScalarString
from ruamel.yaml.tokens import CommentToken

from splitstream.common.errors import ConfigError
from splitstream.common.experiment import Experiment
from splitstream.common.headers import DEFAULT_ROUTING_KEY_HEADER
from splitstream.common.registry import parse_registry
from splitstream.common.registry.base import RegistryState


class EditError(Exception):
    """The file cannot be edited so that it reads back as intended; nothing should be written."""


def edit_experiment(text: str, model: str, experiment: Experiment) -> str:
    """``text`` (a valid registry) with ``model``'s experiment replaced by ``experiment``."""
    before = parse_registry(yaml.safe_load(text))
    for in_place in (True, False):
        edited = _edit(text, model, experiment, before, in_place=in_place)
        if _reads_as(edited, before, model, experiment):
            return edited
    raise EditError(f"model '{model}': the edited file would not read back as the new experiment")


def _edit(text: str, model: str, experiment: Experiment, before: RegistryState, *, in_place: bool) -> str:
    handler = YAML()  # round-trip
    handler.preserve_quotes = True
    handler.width = 1 << 16  # never fold a long line the file did not fold
    try:
        document = handler.load(text)
    except RoundTripError as error:
        raise EditError(str(error)) from None
    mapping, sequence, offset = _indentation(document)
    handler.indent(mapping=mapping, sequence=sequence, offset=offset)
    original = text.splitlines(keepends=True)
    start, end = _markers(original)
    handler.explicit_start = start is not None
    handler.explicit_end = end is not None
    entry = document["models"][model]
    node = entry.get("experiment")
    if in_place and isinstance(node, CommentedMap):
        _update(node, before.models[model].experiment, experiment)
    elif "experiment" in entry:
        entry["experiment"] = _fresh(experiment)
    else:
        _append(entry, _fresh(experiment), key="experiment")
    out = io.StringIO()
    handler.dump(document, out)
    return _reframe(original, out.getvalue())


def _reads_as(text: str, before: RegistryState, model: str, experiment: Experiment) -> bool:
    """Whether ``text`` reads, as routers read it, as ``before`` with only ``model``'s experiment changed."""
    try:
        after = parse_registry(yaml.safe_load(text))
    except (ConfigError, yaml.YAMLError):
        return False
    if set(after.models) != set(before.models):
        return False
    edited = after.models[model]
    return (
        edited.experiment == experiment
        and edited.endpoints == before.models[model].endpoints
        and all(after.models[name] == entry for name, entry in before.models.items() if name != model)
    )


# -- the edit ----------------------------------------------------------------------------------------


def _update(node: CommentedMap, old: Experiment, new: Experiment) -> None:
    """Set only the fields of ``node`` (which reads as ``old``) whose value differs in ``new``."""
    for key in ("salt", "control", "routing_key_header"):
        if getattr(old, key) == getattr(new, key):
            continue
        value = _string(getattr(new, key), like=node.get(key))
        if key in node:
            node[key] = value
        elif key == "salt":
            node.insert(0, key, value)  # where it is usually written
        else:
            _append(node, value, key=key)
    _update_items(node, "arms", "weight", None, {a.version: a.weight for a in new.arms})
    _update_items(node, "shadows", "sample_rate", 1.0, {s.version: s.sample_rate for s in new.shadows})


def _update_items(node: CommentedMap, key: str, field: str, default: float | None, wanted: dict[str, float]) -> None:
    """Arms or shadows, matched by version: drop the versions gone, set changed values, append the new ones."""
    items = node.get(key)
    if not items and not wanted:
        return
    if not isinstance(items, CommentedSeq):  # absent, null or an empty flow sequence
        fresh = CommentedSeq(_item(version, field, value) for version, value in wanted.items())
        if key in node:
            node[key] = fresh
        else:
            _append(node, fresh, key=key)
        return
    for index in reversed(range(len(items))):
        item = items[index]
        version = str(item["version"])
        if version not in wanted:
            _delete(node, key, items, index)
        elif float(item.get(field, default)) != wanted[version]:
            item[field] = _number(wanted[version])
    present = {str(item["version"]) for item in items}
    for version, value in wanted.items():
        if version not in present:
            item = _item(version, field, value)
            if items and isinstance(items[-1], CommentedMap) and items[-1].fa.flow_style():
                item.fa.set_flow_style()  # like its siblings: - {version: v3, weight: 10}
            _append(items, item)


def _fresh(experiment: Experiment) -> CommentedMap:
    """The whole experiment as a new mapping (fields at their defaults left out)."""
    mapping = experiment.to_mapping()
    if not mapping["shadows"]:
        del mapping["shadows"]
    if mapping["routing_key_header"] == DEFAULT_ROUTING_KEY_HEADER:
        del mapping["routing_key_header"]
    fresh: CommentedMap = _styled(mapping)
    return fresh


def _item(version: str, field: str, value: float) -> CommentedMap:
    item: CommentedMap = _styled({"version": version, field: value})
    return item


def _styled(value: Any) -> Any:
    """Plain data as ruamel nodes, strings quoted where PyYAML would misread them and whole numbers as ints."""
    if isinstance(value, dict):
        return CommentedMap((key, _styled(item)) for key, item in value.items())
    if isinstance(value, list):
        return CommentedSeq(_styled(item) for item in value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, float):
        return _number(value)
    return value


def _append(collection: CommentedMap | CommentedSeq, value: Any, *, key: Any = None) -> None:
    """Add ``value`` at the end of ``collection`` (under ``key`` in a mapping), before the comment lines and
    blank lines that followed its old last line: those belong to what comes next, a model below, say."""
    tail = _detach_tail(collection)
    if isinstance(collection, CommentedMap):
        collection[key] = value
    else:
        collection.append(value)
    if tail is not None:
        _attach(*_tail_slot(collection), tail)


def _delete(node: CommentedMap, key: str, items: CommentedSeq, index: int) -> None:
    """Remove ``items[index]`` (``node[key]`` is ``items``), keeping the comment lines and blank lines after
    it when it is the last item: they move to the new last line."""
    tail = _detach_tail(items) if index == len(items) - 1 else None
    del items[index]
    if not items:  # ``key: []``, the lines after it kept after it
        items = node[key] = CommentedSeq()
        items.fa.set_flow_style()
    if tail is not None:
        holder, slot, position = _tail_slot(items) if items else (node, key, 2)
        _attach(holder, slot, position, tail)


def _tail_slot(node: CommentedMap | CommentedSeq) -> tuple[Any, Any, int]:
    """Where ruamel keeps the comment after the last line of a block collection: on its last entry (on the
    entry's value in a mapping, index 2; on the item in a sequence, index 0), or deeper in a block value."""
    while True:
        last: Any = next(reversed(node)) if isinstance(node, CommentedMap) else len(node) - 1
        value = node[last]
        if not _is_block(value):
            return node, last, 2 if isinstance(node, CommentedMap) else 0
        node = value


def _detach_tail(node: CommentedMap | CommentedSeq) -> CommentToken | None:
    """Cut the comment lines and blank lines after ``node``'s last line off it (an end-of-line comment
    stays) and return them, as a token whose text starts at the next line; None when there are none."""
    if not _is_block(node):
        return None
    holder, slot, position = _tail_slot(node)
    held = holder.ca.items.get(slot)
    token = held[position] if held and len(held) > position else None
    if not isinstance(token, CommentToken):
        return None
    head, newline, rest = token.value.partition("\n")
    if not rest:
        return None
    token.value = head + newline
    return CommentToken(rest, token.start_mark, token.end_mark)


def _attach(holder: CommentedMap | CommentedSeq, slot: Any, position: int, tail: CommentToken) -> None:
    """Put ``tail`` (from :func:`_detach_tail`) after the line of ``holder[slot]``."""
    held = holder.ca.items.setdefault(slot, [None, None, None, None])
    held.extend([None] * (position + 1 - len(held)))
    token = held[position]
    if isinstance(token, CommentToken):  # an end-of-line comment there: the lines follow it
        token.value = token.value.rstrip("\n") + "\n" + tail.value
    else:
        held[position] = CommentToken("\n" + tail.value, tail.start_mark, tail.end_mark)


_STRING_TAG = "tag:yaml.org,2002:str"
_RESOLVER = yaml.resolver.Resolver()


def _string(value: str, *, like: Any = None) -> Any:
    """``value`` quoted as the value it replaces was, and quoted anyway where PyYAML would read it plain as
    something other than this string (``yes``, ``1:30``, ``null``)."""
    if isinstance(like, SingleQuotedScalarString | DoubleQuotedScalarString):
        return type(like)(value)
    if _RESOLVER.resolve(yaml.ScalarNode, value, (True, False)) != _STRING_TAG:
        return SingleQuotedScalarString(value)
    return value


def _number(value: float) -> float:
    """Whole numbers as ints (``90``, not ``90.0``)."""
    return int(value) if float(value).is_integer() else value


# -- how the file is laid out ------------------------------------------------------------------------


def _indentation(document: Any) -> tuple[int, int, int]:
    """ruamel's (mapping, sequence, offset) indents as the file's block collections use them: a nested
    mapping's keys are ``mapping`` columns right of its parent key; a sequence's dashes ``offset`` and its
    items ``sequence`` columns right of it. PyYAML's style (2, 2, 0) where the file shows none."""
    mappings: Counter[int] = Counter()
    sequences: Counter[tuple[int, int]] = Counter()
    seen: set[int] = set()

    def walk(node: Any) -> None:
        if id(node) in seen:  # an alias
            return
        seen.add(id(node))
        if isinstance(node, CommentedMap):
            for key, value in node.items():
                if key not in node.lc.data:  # merged in with ``<<``: laid out elsewhere
                    continue
                column = node.lc.key(key)[1]
                if _is_block(value) and isinstance(value, CommentedMap):
                    mappings[value.lc.col - column] += 1
                elif _is_block(value) and isinstance(value, CommentedSeq):
                    sequences[(value.lc.item(0)[1] - column, value.lc.col - column)] += 1
                walk(value)
        elif isinstance(node, CommentedSeq):
            for item in node:
                walk(item)

    walk(document)
    mapping = mappings.most_common(1)[0][0] if mappings else 2
    sequence, offset = sequences.most_common(1)[0][0] if sequences else (mapping, 0)
    return mapping, sequence, offset


def _is_block(node: Any) -> bool:
    return isinstance(node, CommentedMap | CommentedSeq) and len(node) > 0 and not node.fa.flow_style()


_START = re.compile(r"---[ \t]*(#.*)?")
_END = re.compile(r"\.\.\.[ \t]*(#.*)?")


def _markers(lines: list[str]) -> tuple[int | None, int | None]:
    """The indexes of the line ``---`` opening the document (after comments and directives) and of the line
    ``...`` closing it (before comments), None where there is none."""
    content = [i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")]
    opening = next((i for i in content if not lines[i].startswith("%")), None)
    start = opening if opening is not None and _START.fullmatch(lines[opening].rstrip("\r\n")) else None
    end = content[-1] if content and _END.fullmatch(lines[content[-1]].rstrip("\r\n")) else None
    return start, end


def _reframe(original: list[str], dumped: str) -> str:
    """ruamel drops what comes before ``---`` (comments, directives) and after ``...``: the file's own lines
    there, and its marker lines, replace what ruamel wrote."""
    lines = dumped.splitlines(keepends=True)
    start, end = _markers(original)
    dumped_start, dumped_end = _markers(lines)
    if end is not None and dumped_end is not None:
        lines = lines[:dumped_end] + original[end:]
    if start is not None and dumped_start is not None:
        after = dumped_start + 1
        comment = _START.fullmatch(original[start].rstrip("\r\n"))
        if comment and comment[1] and after < len(lines) and lines[after].strip() == comment[1]:
            after += 1  # ``--- # comment``: ruamel writes the comment on a line of its own
        lines = original[: start + 1] + lines[after:]
    return "".join(lines)
