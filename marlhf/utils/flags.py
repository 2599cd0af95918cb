"""Flags declared where they are used: in sections.

A *section* is a frozen dataclass holding what one part of the system reads (the data pipeline, the loop, the
termination rule, the PPO update, ...).  Each of its fields is one of:

- a **flag** (:func:`flag`): declared here once — its command-line name, default and help.  A stage's flat
  argument class (:mod:`marlhf.config`: DeepSpeed-Chat's flat flag names) is generated from its sections
  (:func:`flat_flags`), and the eval tools add the flags they share with training from the same sections
  (:func:`add_flags`);
- **derived** (:func:`derived`): read from a flag another section declares, or given by the caller (a value the
  run resolved: the tokenizer's stop ids, the model paths);
- a **nested section**: built from the same flags.

:meth:`Section.build` is the one way a section is made from parsed flags — there are no per-section builders.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import pkgutil
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class Flag:
    """One command-line flag: ``--name``, its default and help (``type``: the annotation argparse parses with;
    ``parse(value, args)``: the section's value from the flag's, None when they are the same)."""

    name: str
    default: Any
    help: str
    choices: Any = None
    aliases: tuple[str, ...] = ()
    type: Any = None
    parse: Callable[[Any, Any], Any] | None = None


def flag(default, help: str, *, choices=None, aliases=(), name: str | None = None,  # noqa: A002 - argparse's name
         type=None, parse: Callable[[Any, Any], Any] | None = None, resolved: bool = False):  # noqa: A002
    """A section field that is a command-line flag.  ``name``: the flag when it differs from the field's name (the
    flat DeepSpeed-Chat name, e.g. the field ``generation_batch`` is ``--per_device_generation_batch_size``);
    ``type``: what the flag parses as when the field holds something else (``parse`` turns one into the other);
    ``resolved``: the flag is only the run's input to the value (``--response_kind auto``, an empty model path):
    :meth:`Section.build` must be given the value the run resolved."""
    spec = {"name": name, "default": default, "help": help, "choices": choices, "aliases": tuple(aliases),
            "type": type, "parse": parse, "resolved": resolved}
    kwargs = {"default": tuple(default)} if isinstance(default, list) else {"default": default}
    if parse is not None:  # the field's own value is the parsed one: no default for it
        kwargs = {}
    return field(metadata={"flag": spec}, **kwargs)


def derived(read: Callable[[Any], Any] | None = None):
    """A section field that is not a flag: ``read(args)`` takes it from a flag another section declares; without
    ``read`` it is given to :meth:`Section.build` by the caller (a value the run resolved)."""
    return field(metadata={"derived": read})


class Section:
    """Base of the sections: ``TITLE`` is the ``--help`` group of its flags."""

    TITLE: ClassVar[str] = ""

    @classmethod
    def flags(cls) -> list[Flag]:
        """The flags this section declares (nested sections' not included), in field order."""
        hints = typing.get_type_hints(cls)
        out = []
        for f in dataclasses.fields(cls):
            spec = f.metadata.get("flag")
            if spec is None:
                continue
            typ = spec["type"] if spec["type"] is not None else _flag_type(hints[f.name])
            out.append(Flag(name=spec["name"] or f.name, default=spec["default"], help=spec["help"],
                            choices=spec["choices"], aliases=spec["aliases"], type=typ, parse=spec["parse"]))
        return out

    @classmethod
    def nested(cls) -> list[type[Section]]:
        """The sections nested in this one (built from the same flags)."""
        hints = typing.get_type_hints(cls)
        return [hints[f.name] for f in dataclasses.fields(cls) if _is_section(hints[f.name])]

    @classmethod
    def build(cls, args, **given):
        """The section from parsed flags ``args`` (any object with the flat flag names as attributes); ``given``:
        the values of derived fields the caller resolved (a flag given here overrides the flag's value)."""
        hints = typing.get_type_hints(cls)
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in given:
                values[f.name] = given.pop(f.name)
            elif "flag" in f.metadata and not f.metadata["flag"]["resolved"]:
                spec = f.metadata["flag"]
                value = getattr(args, spec["name"] or f.name)
                if spec["parse"] is not None:
                    value = spec["parse"](value, args)
                elif isinstance(value, list):
                    value = tuple(value)
                values[f.name] = value
            elif _is_section(hints[f.name]):
                values[f.name] = hints[f.name].build(args)
            elif f.metadata.get("derived") is not None:
                values[f.name] = f.metadata["derived"](args)
            else:
                raise TypeError(f"{cls.__name__}.{f.name} is resolved by the run: pass it to "
                                f"{cls.__name__}.build(args, {f.name}=...)")
        if given:
            raise TypeError(f"{cls.__name__} has no field {', '.join(sorted(given))}")
        return cls(**values)


def _is_section(hint) -> bool:
    return isinstance(hint, type) and issubclass(hint, Section)


def section_flags(*sections: type[Section], skip=()) -> list[tuple[type[Section], Flag]]:
    """Every flag of ``sections`` (nested sections' after their parent's, each section once, none of ``skip``),
    with its section."""
    seen, out = set(skip), []

    def visit(sec):
        if sec in seen:
            return
        seen.add(sec)
        out.extend((sec, f) for f in sec.flags())
        for sub in sec.nested():
            visit(sub)

    for sec in sections:
        visit(sec)
    return out


def flat_flags(*sections: type[Section]):
    """Class decorator (under ``@dataclass``): the flat fields of ``sections``' flags — DeepSpeed-Chat's flat
    flag names, each default and help as its section declares it — added to the class before its own fields.  A
    flag name declared twice is an error: each flag has one home."""

    def wrap(cls):
        own = dict(cls.__dict__.get("__annotations__", {}))
        inherited = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base)
                     for f in dataclasses.fields(base)}
        had = getattr(cls, "FLAG_SECTIONS", ())  # a base's sections (a nested one is not added twice)
        annotations = {}
        flags = section_flags(*sections, skip=had)
        cls.FLAG_SECTIONS = tuple(had) + tuple(dict.fromkeys(sec for sec, _ in flags))
        for sec, spec in flags:
            if spec.name in annotations or spec.name in own or spec.name in inherited:
                raise TypeError(f"--{spec.name} is declared twice ({sec.__name__} and {cls.__name__} or a section "
                                f"before it)")
            annotations[spec.name] = spec.type
            default = spec.default
            kwargs = ({"default_factory": (lambda d=default: list(d))} if isinstance(default, (list, tuple))
                      else {"default": default})
            setattr(cls, spec.name, field(metadata={"help": spec.help, "choices": spec.choices,
                                                    "aliases": spec.aliases, "group": sec.TITLE}, **kwargs))
        cls.__annotations__ = {**annotations, **own}
        return cls

    return wrap


# ---------------------------------------------------------------------------------------------------------
# flags -> argparse
# ---------------------------------------------------------------------------------------------------------
def _flag_type(hint):
    """The flag's annotation from a section field's: a tuple field is a list flag."""
    if typing.get_origin(hint) is tuple:
        return list[typing.get_args(hint)[0]]
    return hint


def base_type(annotation):
    """(python type, is_list, is_optional) of an annotation such as ``float | None`` or ``list[str]``."""
    hint, optional = annotation, False
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint, origin, optional = args[0], typing.get_origin(args[0]), True
    if origin in (list, tuple):
        return typing.get_args(hint)[0], True, optional
    return hint, False, optional


def add_argument(group, name: str, annotation, help: str, choices=None, aliases=(),  # noqa: A002
                 default=argparse.SUPPRESS) -> None:
    """One flag on an argparse parser or group: booleans are switches, lists take one or more values, ``X | None``
    also accepts 'none'."""
    typ, is_list, optional = base_type(annotation)
    names = [f"--{name}", *aliases]
    kwargs = {"help": help, "dest": name}
    if default is not argparse.SUPPRESS:
        kwargs["default"] = list(default) if isinstance(default, tuple) else default
    if typ is bool:
        group.add_argument(*names, action="store_true", **kwargs)
        return
    kwargs["type"] = _none_or(typ) if optional else typ
    if is_list:
        kwargs["nargs"] = "+"
    if choices:
        kwargs["choices"] = choices
    group.add_argument(*names, **kwargs)


def add_flags(parser: argparse.ArgumentParser, *sections: type[Section], only: tuple[str, ...] | None = None,
              help: dict[str, str] | None = None) -> None:  # noqa: A002
    """Add ``sections``' flags (``only`` those named, when given) to a tool's parser, with their sections'
    defaults; ``help``: a tool's own wording for some of them (what the flag means there)."""
    flags = {f.name: f for _, f in section_flags(*sections)}
    missing = sorted(set(only or ()) - flags.keys())
    if missing:
        raise KeyError(f"no section among {[s.__name__ for s in sections]} declares {missing}")
    for name in only or flags:
        f = flags[name]
        add_argument(parser, f.name, f.type, (help or {}).get(name, f.help), f.choices, f.aliases, f.default)


def _none_or(typ):
    def convert(text: str):
        return None if text.lower() == "none" else typ(text)

    convert.__name__ = typ.__name__
    return convert


# ---------------------------------------------------------------------------------------------------------
# flags naming a component
# ---------------------------------------------------------------------------------------------------------
def component_names(package: str) -> tuple[str, ...]:
    """The components of a registry package (the termination rules, the advantage estimators): one module per
    component, named as it — listed without importing them, so that ``--help`` needs no torch."""
    spec = importlib.util.find_spec(package)
    return tuple(sorted(m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)))


class Components:
    """The ``choices`` of a flag naming a component: the package's modules when asked (a module added to the
    package is a valid value at once)."""

    def __init__(self, package: str):
        self.package = package

    def __iter__(self):
        return iter(component_names(self.package))

    def __contains__(self, name) -> bool:
        return name in component_names(self.package)

    def __len__(self) -> int:
        return len(component_names(self.package))

    def __repr__(self) -> str:
        return repr(component_names(self.package))
