"""Termination rules and advantage estimators are components (marlhf/rlhf/termination, marlhf/rlhf/advantages):
the command line offers exactly the registered ones, and a new one is one new file — shown here with a toy
rule and a toy estimator written to a folder of the package, taken by the flags and the rollout as they are."""

import argparse
import sys

import pytest
import torch
from maths_helpers import rollout_section, segments_for_rule

from marlhf.config import RLHFArgs, parse_args
from marlhf.embedded import default_model
from marlhf.rlhf import advantages, termination
from marlhf.rlhf.sections import MacroSection
from marlhf.utils.flags import component_names


def field_choices(name):
    import dataclasses

    return next(f for f in dataclasses.fields(RLHFArgs) if f.name == name).metadata["choices"]


def test_the_flags_offer_exactly_the_registered_components():
    assert set(field_choices("termination_condition")) == set(termination.RULES) == {
        "fixed", "randomized", "ppl", "parsing", "word", "lowprob"}
    assert set(field_choices("advantage_estimator")) == set(advantages.ESTIMATORS) == {
        "gae", "rloo", "grpo", "reinforce", "mc_macro"}


def test_a_component_must_live_in_a_module_of_its_name():
    with pytest.raises(ValueError, match="must live in a module of that name"):
        @termination.register("elsewhere")
        class Elsewhere(termination.TerminationRule):  # noqa: F841  (defined in this test module)
            pass


@pytest.fixture
def package_folder(tmp_path):
    """A folder added to both component packages' search path: a file written there is a new component."""
    added = []
    for pkg in (termination, advantages):
        folder = tmp_path / pkg.__name__.rsplit(".", 1)[-1]
        folder.mkdir()
        pkg.__path__.append(str(folder))
        added.append((pkg, folder))
    yield {pkg: folder for pkg, folder in added}
    for pkg, folder in added:
        pkg.__path__.remove(str(folder))
        for name in [m for m in sys.modules if m.startswith(pkg.__name__ + ".toy_")]:
            del sys.modules[name]
    termination.RULES.pop("toy_every_third", None)
    advantages.ESTIMATORS.pop("toy_raw_return", None)


TOY_RULE = '''
from marlhf.rlhf.macro import fixed_starts
from marlhf.rlhf.termination import TerminationRule, register


@register("toy_every_third")
class EveryThird(TerminationRule):
    def starts(self, answers):
        return fixed_starts(answers.mask, 3)
'''

TOY_ESTIMATOR = '''
from marlhf.rlhf.advantages import SequenceEstimator, register
from marlhf.embedded import default_model


@register("toy_raw_return")
class RawReturn(SequenceEstimator):
    def advantages(self, returns, valid):
        return returns.double() * valid
'''


def test_a_new_rule_and_estimator_are_one_file_each(package_folder):
    from marlhf.models.loading import load_tokenizer
    from marlhf.rlhf.advantages import AdvantageBatch, EstimatorOptions, check_estimator_options
    from marlhf.rlhf.segmentation import MacroSegmenter

    (package_folder[termination] / "toy_every_third.py").write_text(TOY_RULE)
    (package_folder[advantages] / "toy_raw_return.py").write_text(TOY_ESTIMATOR)
    assert "toy_every_third" in component_names("marlhf.rlhf.termination")
    # the flags take them (their choices are the packages' modules)
    args, _ = parse_args(RLHFArgs, ["--termination_condition", "toy_every_third", "--advantage_estimator",
                                 "toy_raw_return", "--policy_ratio", "macro"])
    check_estimator_options(EstimatorOptions(estimator="toy_raw_return", num_samples_per_prompt=1,
                                             kl_penalty="reward", grpo_normalization="std", policy_ratio="macro",
                                             termination_changed=True, value_function="equal", macro_reward="sum",
                                             gamma=1.0, lam_changed=False, whiten_advantages=False))
    # the rule: built from its section like the others, segments every 3 tokens
    mask = torch.tensor([[1] * 7 + [0], [1] * 8, [1, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    seg_fn = MacroSegmenter(MacroSection.build(args, response_kind="text"), load_tokenizer(default_model("")), seed=0)
    seg, fallbacks = seg_fn(torch.zeros_like(mask, dtype=torch.long), mask, torch.zeros(mask.shape), step=0)
    assert torch.equal(seg, segments_for_rule("fixed", mask, ngram=3)) and fallbacks == 0
    assert seg[1].tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    # the estimator: the answer's return is its advantage, on every token
    est = advantages.build_estimator(rollout_section(advantage_estimator="toy_raw_return", kl_ctl=0.0,
                                                     clip_reward_value=None))
    assert not est.needs_critic
    scores = torch.tensor([1.5, -2.0, 0.25])
    zeros = torch.zeros(mask.shape)
    adv, returns, stats = est(AdvantageBatch(mask, torch.ones(3, dtype=torch.bool), seg, zeros, zeros, None, None,
                                             scores))
    assert adv[mask].tolist() == [1.5] * 7 + [-2.0] * 8 + [0.25] * 2 and float(adv[~mask].abs().sum()) == 0.0
    assert float(stats["num_macros"]) == pytest.approx((3 + 3 + 1) / 3)


def test_an_unknown_component_names_the_valid_ones():
    with pytest.raises(ValueError, match="fixed, lowprob, parsing, ppl, randomized, word"):
        termination.build_rule(MacroSection(termination_condition="nope", ngram=5, response_kind="text",
                                            split_last=False))
    with pytest.raises(ValueError, match="gae, grpo, mc_macro, reinforce, rloo"):
        advantages.estimator_class("ppo")


def test_each_flag_is_declared_once_in_its_section_and_the_sections_build_from_the_flags():
    """Every flag is declared once — name, default, help — in the section that reads it, and each stage's flat flags
    are generated from its sections: the flat default is the section's (the rollout's KL coefficient was once 0.1 in
    a section and 0.05 on the command line).  The sections are built from the parsed flags by one builder,
    Section.build; a field the run resolves must be given to it."""
    import dataclasses

    from marlhf.cli._run import mappo_sections
    from marlhf.config import DPOArgs, PolicyEvalArgs, RewardArgs, SFTArgs
    from marlhf.eval.generate_tool import PromptSource
    from marlhf.rlhf.sections import BatchSection, EvalSection, ModelsSection, RolloutSection, UpdateSection
    from marlhf.sections import DataSection, LoopSection
    from marlhf.utils.flags import Section, flag, flat_flags, section_flags

    for stage in (SFTArgs, RewardArgs, DPOArgs, RLHFArgs, PolicyEvalArgs):
        flat = {f.name: f for f in dataclasses.fields(stage)}
        declared = section_flags(*stage.FLAG_SECTIONS)
        assert len(declared) == len(flat) == len({spec.name for _, spec in declared}), stage  # one home each
        for section, spec in declared:  # the flat field is the section's declaration
            field = flat[spec.name]
            default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
            assert default == (list(spec.default) if isinstance(spec.default, tuple) else spec.default), spec.name
            assert field.metadata["help"] == spec.help and field.metadata["group"] == section.TITLE, spec.name

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Twice(Section):
        kl_ctl: float = flag(0.1, "a second declaration of step 3's β")

    with pytest.raises(TypeError, match="--kl_ctl is declared twice"):
        flat_flags(*RLHFArgs.FLAG_SECTIONS, Twice)(type("Flat", (), {"__annotations__": {}}))
    with pytest.raises(TypeError, match="response_kind=..."):  # resolved by the run: must be given
        MacroSection.build(RLHFArgs())
    with pytest.raises(TypeError, match="needs_critic"):
        ModelsSection.build(RLHFArgs(), actor_path="a", critic_path="c", reward_path=None,
                            end_of_conversation_token="<e>")
    with pytest.raises(TypeError, match="actor_path=..."):  # an empty --actor_model_name_or_path is resolved
        ModelsSection.build(RLHFArgs(), critic_path="c", reward_path=None, needs_critic=True,
                            end_of_conversation_token="<e>")
    with pytest.raises(TypeError, match="no field bogus"):
        LoopSection.build(RLHFArgs(), bogus=1)

    args, _ = parse_args(RLHFArgs, ["--actor_learning_rate", "3e-5", "--actor_zero_stage", "2", "--critic_weight_decay",
                                    "0.1", "--kl_ctl", "0.2", "--ngram", "inf", "--macro_reward", "compat",
                                    "--ppo_epochs", "2", "--lam", "0.9", "--gradient_accumulation_steps", "2",
                                    "--logprob_temperature", "sampling", "--temperature", "0.7"])
    actor, critic = args.engine("actor"), args.engine("critic")
    assert (actor.stage, actor.learning_rate, actor.zero_stage, actor.weight_decay) == ("actor", 3e-5, 2, 0.0)
    assert (critic.stage, critic.weight_decay, critic.zero_stage) == ("critic", 0.1, args.critic_zero_stage)
    assert actor.schedule.gradient_accumulation_steps == critic.schedule.gradient_accumulation_steps == 2
    rollout, update, macro = (RolloutSection.build(args), UpdateSection.build(args),
                              MacroSection.build(args, response_kind="code"))
    assert rollout.policy == update.policy and rollout.policy.kl_ctl == 0.2
    assert rollout.policy.logprob_temperature == 0.7  # '--logprob_temperature sampling': --temperature's value
    assert rollout.lam == 0.9 and update.batches.ppo_epochs == 2
    assert update.batches.schedule.gradient_accumulation_steps == 2
    assert macro.ngram is None and macro.split_last and macro.termination_condition == "fixed"
    assert macro.response_kind == "code"  # the run's resolved kind, not the flag's "auto"
    # step 3's batches, models and evaluation, and the whole of MA-PPO's sections, from the same flags
    args, _ = parse_args(RLHFArgs, ["--per_device_generation_batch_size", "4", "--num_samples_per_prompt", "2",
                                    "--advantage_estimator", "rloo", "--per_device_training_batch_size", "8",
                                    "--lora_dim", "4", "--max_prompt_seq_len", "100", "--max_answer_seq_len", "20",
                                    "--enable_hybrid_engine", "--print_answers", "--print_answers_interval", "5",
                                    "--data_seed", "7"])
    batches = BatchSection.build(args)
    assert (batches.experiences_per_batch, batches.training_batch, batches.actor_micro_steps) == (8, 8, 1)
    models = ModelsSection.build(args, actor_path="a", critic_path="c", reward_path=None, needs_critic=False,
                                 end_of_conversation_token="<e>")
    assert (models.actor_lora_dim, models.critic_lora_dim, models.max_out_tokens, models.reward_path) == \
        (4, 0, 120, None)  # the actor's LoRA rank falls back to --lora_dim
    mappo = mappo_sections(args, response_kind="text", stop_ids=[7], pad_id=0)
    assert mappo.report.every == 5 and mappo.generation.stop_ids == (7,) and mappo.generation.max_new_tokens == 20
    assert mappo.rollout.policy is mappo.update.policy  # the policy's temperature and KL: one section, shared
    assert mappo.update.batches is mappo.batches is mappo.rollout.batches  # epochs, micro-batch, accumulation: once
    assert mappo.rollout.num_samples_per_prompt == 2
    assert EvalSection.build(args).batch == 4  # --per_device_eval_generation_batch_size 0: the training one
    assert LoopSection.build(args).tensorboard_path == "./output/tensorboard"
    fmt = {"end_of_conversation_token": "<e>", "prompt_format": "raw"}  # what the run resolved
    data = DataSection.build(args, **fmt)
    assert (data.max_seq_len, data.max_prompt_seq_len, data.data_path, data.split_seed) == (0, 100, ("synthetic",), 7)
    assert DataSection.build(parse_args(RLHFArgs, ["--seed", "3"])[0], **fmt).split_seed == 3  # no --data_seed
    with pytest.raises(TypeError, match="prompt_format=..."):  # the flag's 'auto' is not a format
        DataSection.build(args, end_of_conversation_token="<e>")
    # the tools' flags come from the same sections: a tool's prompt source reads the training run's split flags
    tool = argparse.ArgumentParser()
    from marlhf.eval.generate_tool import add_prompt_args, add_sampling_args

    add_sampling_args(tool)
    add_prompt_args(tool)
    ns = tool.parse_args(["--data_path", "synthetic", "--max_new_tokens", "9"])
    assert (ns.temperature, ns.top_k, ns.top_p, ns.max_answer_seq_len) == (0.8, 50, 1.0, 9)  # step 3's defaults
    source = PromptSource.build(ns)
    assert (source.data_path, source.data_split, source.data_seed, source.phase) == (("synthetic",), "2,4,4", 1234, 3)
    with pytest.raises(ValueError, match="actor and a critic"):
        args.engine("reward")
