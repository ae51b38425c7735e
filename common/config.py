"""Typed dataclass fields read from text: the one helper behind the trainer's config
(``bert.config``) and ``python -m data.prepare``'s options.

Contract: ``option`` declares a field with its help and choices; ``coerce`` checks a value from
YAML or the command line against the annotation (ints never bool and within 64 bits, floats
finite); ``load_yaml`` reads a file through ``common.files.read_checked`` with no aliases and
bounded depth. Every error is ``error(message)``, one line with values cut to 200 characters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
from dataclasses import MISSING, field, fields

import yaml

from common.files import UnsafeFile, read_checked

MAX_YAML_BYTES = 256 << 10  # a config file; launch/configs' are about 2 KB
MAX_TEXT_BYTES = 64 << 10  # one command-line value
MAX_DEPTH = 32  # nesting of mappings and lists
MAX_NODES = 20_000  # values in one document (pure-Python YAML composes ~10,000 a second)
MAX_INT = 2**63  # ints are 64-bit; Python's are not


def option(default=MISSING, help: str = "", choices: tuple | None = None, **meta):
    """A dataclass field with its help, choices and any further metadata."""
    meta = {"help": help, "choices": choices, **meta}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def cut(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters for an error message."""
    return text if len(text) <= limit else text[: limit - 4] + " ..."


def short(value, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    try:
        return cut(repr(value), limit)
    except ValueError:  # an integer of more than 4,300 digits
        return f"<{type(value).__name__} too long to print>"


def optional(hint):
    """``X | None`` -> (X, True); any other hint -> (hint, False)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return (inner[0] if len(inner) == 1 else hint), True
    return hint, False


def coerce(key: str, value, hint, error=ValueError):
    """``value`` as the annotation ``hint`` asks (a dataclass from a mapping), else ``error``."""
    hint, may_be_none = optional(hint)
    if value is None and may_be_none:
        return None
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, dict):
            raise error(f"{key}: expected a mapping of fields, got {short(value)}")
        valid = [f.name for f in fields(hint)]
        if bad := sorted(set(value) - set(valid), key=str):
            raise error(f"{key}.{short(bad[0], 60)}: unknown field; valid fields of {key}: {valid}")
        return hint(**value)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):  # int | str: a number or a keyword the section checks
        if str in args and isinstance(value, str):
            return value
        return coerce(key, value, next(a for a in args if a is not str), error)
    plain = {bool: "true or false", str: "a string", dict: "a mapping"}
    if hint in plain:
        if not isinstance(value, hint):
            raise error(f"{key}: expected {plain[hint]}, got {short(value)}")
    elif hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise error(f"{key}: expected an integer, got {short(value)}")
        if not -MAX_INT <= value < MAX_INT:
            raise error(f"{key}: {short(value, 40)} does not fit in 64 bits")
    elif hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no decimal point) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise error(f"{key}: expected a number, got {short(value)}")
        try:
            value = float(value)
        except OverflowError:  # an integer beyond float range
            value = math.inf
        if not math.isfinite(value):  # .nan and .inf would pass every range check
            raise error(f"{key}: expected a finite number, got {short(value, 40)}")
    elif origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise error(f"{key}: expected a list, got {short(value)}")
        if origin is list:
            return [coerce(key, v, args[0], error) for v in value]
        if len(value) != len(args):
            raise error(f"{key}: expected a list of {len(args)} values, got {short(value)}")
        return tuple(coerce(key, v, a, error) for v, a in zip(value, args))
    return value


def check_choices(key: str, obj, error=ValueError) -> None:
    """Coerce every field of the dataclass ``obj`` in place and check its choices."""
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        value = coerce(f"{key}.{f.name}", getattr(obj, f.name), hints[f.name], error)
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise error(f"{key}.{f.name}: {short(value)} is not one of {list(choices)}")
        object.__setattr__(obj, f.name, value)


class _BoundedLoader(yaml.SafeLoader):
    """YAML without aliases (a 376-byte alias bomb expands to gigabytes), nesting and size bounded."""

    depth = nodes = 0

    def fetch_flow_collection_start(self, token_class):
        if self.flow_level >= MAX_DEPTH:  # the scanner's work grows with the depth: refuse it here
            raise yaml.YAMLError(f"line {self.line + 1}: nested deeper than {MAX_DEPTH} levels")
        super().fetch_flow_collection_start(token_class)

    def compose_node(self, parent, index):
        mark = self.peek_event().start_mark
        if self.check_event(yaml.AliasEvent):
            raise yaml.YAMLError(f"line {mark.line + 1}: aliases (*name) are not accepted")
        self.depth, self.nodes = self.depth + 1, self.nodes + 1
        if self.depth > MAX_DEPTH:
            raise yaml.YAMLError(f"line {mark.line + 1}: nested deeper than {MAX_DEPTH} levels")
        if self.nodes > MAX_NODES:
            raise yaml.YAMLError(f"line {mark.line + 1}: more than {MAX_NODES:,} values")
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def parse_yaml(text: str, where: str, error=ValueError):
    """``text`` as YAML under the bounds above; ``error`` naming ``where`` and the line."""
    loader = None
    try:
        loader = _BoundedLoader(text)  # its reader refuses control characters here
        return loader.get_single_data()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise error(f"{where} not valid YAML ({at}{cut(problem)})") from e
    except ValueError as e:  # an integer of more than 4,300 digits
        raise error(f"{where} not a valid value ({cut(str(e).split(':')[0], 80)})") from e
    finally:
        if loader is not None:
            loader.dispose()


def load_yaml(path: str, error=ValueError):
    """The YAML file at ``path``, read with ``read_checked`` (no FIFO, at most MAX_YAML_BYTES)."""
    try:
        text = read_checked(path, max_bytes=MAX_YAML_BYTES, what="config file").decode("utf-8")
    except UnsafeFile as e:
        raise error(str(e)) from e
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror})") from e
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 (byte {e.start})") from e
    return parse_yaml(text, f"{path}:", error)


def parse_text(raw: str, hint, key: str, error=ValueError):
    """A command-line value: a string field takes the text as it is (``null`` for an optional
    one), any other is read as YAML (so ``[0.9,0.98]`` is a list)."""
    inner, may_be_none = optional(hint)
    if inner is str:
        return None if may_be_none and raw in ("null", "~") else raw
    if not raw.strip():
        return ""
    if len(raw) > MAX_TEXT_BYTES:
        raise error(f"{key}: a value of {len(raw):,} characters, over {MAX_TEXT_BYTES:,}")
    return parse_yaml(raw, f"{key}:", error)


def describe_fields(cls, prefix: str) -> list[str]:
    """``prefix.field = default`` and its help, for every field of ``cls`` (nested ones too)."""
    lines, hints = [], typing.get_type_hints(cls)
    for f in fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            lines.extend(describe_fields(hints[f.name], f"{prefix}.{f.name}"))
            continue
        default = f.default if f.default is not MISSING else f.default_factory()
        choices = f.metadata.get("choices")
        extra = f" (one of {', '.join(map(str, choices))})" if choices else ""
        lines.append(f"  {prefix}.{f.name} = {default!r}\n      {f.metadata.get('help', '')}{extra}")
    return lines
