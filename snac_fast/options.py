"""Settings types whose command-line flags are made from their fields: an option's default, help
and flag are written once, on its field (``serve``'s settings, :mod:`snac_fast.serve.settings`).

A field made with :func:`option` is a flag; a field made with :func:`part` holds another settings
type, whose options become a group of flags of their own. Importing this module imports no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, Callable


def option(default: Any, help: str, *, flag: str | None = None, parse: Callable[[str], Any] | None = None,
           shown: str | None = None, choices: tuple | None = None, aliases: dict[str, Any] | None = None) -> Any:
    """A field that is also a flag: ``flag`` (default ``--field-name``), ``parse`` for a flag whose
    text is not the value's type, ``shown`` for the default in ``--help``, ``aliases``: flags of no
    value that set it (``{"--engine-thread": "thread"}``, kept for earlier command lines)."""
    meta = {"help": help, "flag": flag, "parse": parse, "shown": shown, "choices": choices, "aliases": aliases or {}}
    return dataclasses.field(default=default, metadata={"option": meta})


def part(kind: type, title: str) -> Any:
    """A field holding the settings type ``kind`` (its defaults), whose flags form the group ``title``."""
    return dataclasses.field(default_factory=kind, metadata={"part": title})


def flag_of(kind: type, name: str) -> str:
    """The flag of ``kind``'s option ``name``, looked for in its parts too."""
    for f in dataclasses.fields(kind):
        if f.name == name and "option" in f.metadata:
            return f.metadata["option"]["flag"] or "--" + name.replace("_", "-")
        if "part" in f.metadata:
            try:
                return flag_of(f.default_factory, name)
            except KeyError:
                pass
    raise KeyError(name)


def as_flags(kind: type, message: str) -> str:
    """``message`` with each option of ``kind`` it names (``files_per_shard``) named as its flag."""
    names = [f.name for f in _options(kind)]
    return re.sub(r"\b(" + "|".join(names) + r")\b", lambda m: flag_of(kind, m.group(1)), message) if names else message


def _options(kind: type) -> list[dataclasses.Field]:
    """The option fields of ``kind`` and of its parts."""
    found = []
    for f in dataclasses.fields(kind):
        if "part" in f.metadata:
            found += _options(f.default_factory)
        elif "option" in f.metadata:
            found.append(f)
    return found


def add_arguments(parser: argparse.ArgumentParser, kind: type, group: Any = None) -> None:
    """One flag per option of ``kind`` (a group per part), each with its default in its help."""
    for f in dataclasses.fields(kind):
        if "part" in f.metadata:
            add_arguments(parser, f.default_factory, parser.add_argument_group(f.metadata["part"]))
            continue
        if "option" not in f.metadata:
            continue
        meta, flag, target = f.metadata["option"], flag_of(kind, f.name), group or parser
        if f.type in ("bool", bool):
            target.add_argument(flag, dest=f.name, action="store_true", default=f.default, help=meta["help"])
            continue
        shown = meta["shown"] if meta["shown"] is not None else f.default
        kind_of = {"int": int, "float": float}.get(str(f.type).split(" ")[0]) if meta["parse"] is None else str
        text = meta["help"] if "(default:" in meta["help"] else f"{meta['help']} (default: {shown})"
        target.add_argument(flag, dest=f.name, type=kind_of, default=f.default if meta["parse"] is None else shown,
                            choices=meta["choices"], metavar=flag[2:].upper().replace("-", "_"), help=text)
        for alias, value in meta["aliases"].items():
            target.add_argument(alias, dest=f.name, action="store_const", const=value, help=argparse.SUPPRESS)


def from_arguments(kind: type, args: argparse.Namespace) -> Any:
    """``kind`` built from the flags :func:`add_arguments` made (not checked)."""
    values = {}
    for f in dataclasses.fields(kind):
        if "part" in f.metadata:
            values[f.name] = from_arguments(f.default_factory, args)
        elif "option" in f.metadata:
            text, parse = getattr(args, f.name), f.metadata["option"]["parse"]
            values[f.name] = parse(text) if parse and isinstance(text, str) else text
    return kind(**values)


def to_dict(settings: Any, leave_out: tuple[str, ...] = ()) -> dict:
    """The options of ``settings`` (parts as nested dicts), for JSON."""
    return {f.name: to_dict(getattr(settings, f.name)) if "part" in f.metadata else getattr(settings, f.name)
            for f in dataclasses.fields(settings) if ("part" in f.metadata or "option" in f.metadata)
            and f.name not in leave_out}


def parts_of(kind: type) -> dict[str, type]:
    """``kind``'s parts: field name -> the settings type it holds."""
    return {f.name: f.default_factory for f in dataclasses.fields(kind) if "part" in f.metadata}


def from_dict(kind: type, values: dict) -> Any:
    """What :func:`to_dict` made, back as ``kind``."""
    parts = parts_of(kind)
    return kind(**{k: from_dict(parts[k], v) if k in parts else v for k, v in values.items()})
