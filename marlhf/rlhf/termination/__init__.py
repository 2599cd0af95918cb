"""Termination rules ζ as components: each rule is one class in one file of this package, registered by name,
built once from the ``macro`` section of the step-3 settings and asked for the macro-action starts of a batch.

    rule = build_rule(MacroSection.from_args(args), tokenizer)     # marlhf.rlhf.sections
    starts = rule.starts(answers)            # (B, A) bool: the first token of each macro action

A rule only decides where macro actions start; :class:`~marlhf.rlhf.segmentation.MacroSegmenter` turns the
starts into segment ids (:func:`marlhf.rlhf.macro.segments_from_starts`), and the maths after it (macro values,
rewards, GAE) does not know which rule ran.  The tensor functions behind the rules live in
:mod:`marlhf.rlhf.macro` (and :mod:`marlhf.rlhf.parsing`) and are tested against loop references there.

Adding a rule: a new module here with a :class:`TerminationRule` subclass decorated with ``@register("name")``
(this package imports every module in it), and its test.  ``--termination_condition`` accepts every
registered name.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import ClassVar

import torch

from marlhf.rlhf.sections import MacroSection


@dataclass
class Answers:
    """One rollout batch's answers, as a rule may need them (all (B, A), right-padded)."""

    ids: torch.Tensor  # answer token ids
    mask: torch.Tensor  # bool, real answer tokens
    ref_logprobs: torch.Tensor  # log π_ref of each answer token
    generator: torch.Generator  # the batch's own stream (seeded by run seed, step, batch, rank)


class TerminationRule:
    """A macro-action termination rule: ``starts(answers)`` → (B, A) bool, True at the first token of each
    macro action (position 0 included; padding ignored).  ``fallbacks`` counts samples a rule could not
    segment its own way since the last call (the parsing rule's parse failures); 0 for the others."""

    name: ClassVar[str] = ""

    def __init__(self, section: MacroSection, tokenizer):
        self.section = section
        self.fallbacks = 0

    def starts(self, answers: Answers) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


RULES: dict[str, type[TerminationRule]] = {}


def register(name: str):
    """Class decorator: make ``name`` a value of ``--termination_condition``."""

    def add(cls: type[TerminationRule]) -> type[TerminationRule]:
        if cls.__module__.rsplit(".", 1)[-1] != name:  # the command line lists the modules' names
            raise ValueError(f"termination rule {name!r} must live in a module of that name, not {cls.__module__}")
        if name in RULES:
            raise ValueError(f"termination rule {name!r} registered twice ({RULES[name].__module__}, {cls.__module__})")
        cls.name = name
        RULES[name] = cls
        return cls

    return add


def build_rule(section: MacroSection, tokenizer=None) -> TerminationRule:
    """The rule ``section.termination_condition`` names, built once for a run."""
    name = section.termination_condition
    if name not in RULES and name in _module_names():  # a module added since this package was imported
        importlib.import_module(f"{__name__}.{name}")
    try:
        cls = RULES[name]
    except KeyError:
        raise ValueError(f"termination_condition={section.termination_condition!r} is not valid; choose one of "
                         f"{', '.join(RULES)}") from None
    return cls(section, tokenizer)


def _module_names() -> list[str]:
    return [m.name for m in pkgutil.iter_modules(__path__)]


for _name in _module_names():  # every rule module registers itself
    importlib.import_module(f"{__name__}.{_name}")
