"""Termination rules ζ as components: each rule is one class in one file of this package, registered by name,
built once from the ``macro`` section of the step-3 settings and asked for the macro-action starts of a batch.

    rule = build_rule(MacroSection.build(args, response_kind="text"), tokenizer)  # marlhf.rlhf.sections
    starts = rule.starts(answers)            # (B, A) bool: the first token of each macro action

A rule only decides where macro actions start; :class:`~marlhf.rlhf.segmentation.MacroSegmenter` turns the
starts into segment ids (:func:`marlhf.rlhf.macro.segments_from_starts`), and the maths after it (macro values,
rewards, GAE) does not know which rule ran.  The tensor functions behind the rules live in
:mod:`marlhf.rlhf.macro` (and :mod:`marlhf.parsing`) and are tested against loop references there.

Adding a rule: a new module here with a :class:`TerminationRule` subclass decorated with ``@register("name")``
(this package imports every module in it), and its test.  ``--termination_condition`` accepts every
registered name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from marlhf.rlhf.registry import Registry
from marlhf.rlhf.sections import MacroSection


@dataclass
class Answers:
    """One rollout batch's answers, as a rule may need them (all (B, A), right-padded)."""

    ids: torch.Tensor  # answer token ids
    mask: torch.Tensor  # bool, real answer tokens
    ref_logprobs: torch.Tensor  # log π_ref of each answer token
    generator: torch.Generator  # the batch's own stream (seeded by run seed, step, batch, rank)
    logprobs: torch.Tensor | None = None  # log π_old of each answer token (the sampling policy's)


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

    @classmethod
    def inputs(cls, section: MacroSection) -> frozenset[str]:
        """The log-probabilities the rule reads beside the ids and mask: "ref_logprobs" (the reference's),
        "logprobs" (the sampling policy's); a rollout skips a forward nothing needs (none by default)."""
        return frozenset()


RULES = Registry(__name__, "termination rule", "termination_condition")
register = RULES.register


def rule_inputs(section: MacroSection) -> frozenset[str]:
    """What the rule ``section`` names reads (:meth:`TerminationRule.inputs`), without building it."""
    return RULES.lookup(section.termination_condition).inputs(section)


def build_rule(section: MacroSection, tokenizer=None) -> TerminationRule:
    """The rule ``section.termination_condition`` names, built once for a run."""
    return RULES.lookup(section.termination_condition)(section, tokenizer)


RULES.discover()  # every rule module registers itself
