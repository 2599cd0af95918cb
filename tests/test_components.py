"""Termination rules and advantage estimators are components (marlhf/rlhf/termination, marlhf/rlhf/advantages):
the command line offers exactly the registered ones, and a new one is one new file — shown here with a toy
rule and a toy estimator written to a folder of the package, taken by the flags and the rollout as they are."""

import sys

import pytest
import torch
from maths_helpers import rollout_section, segments_for_rule

from marlhf.config import RLHFArgs, component_names, parse_args
from marlhf.embedded import default_model
from marlhf.rlhf import advantages, termination
from marlhf.rlhf.sections import MacroSection


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
    seg_fn = MacroSegmenter(MacroSection.from_args(args, "text"), load_tokenizer(default_model("")), seed=0)
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
        termination.build_rule(MacroSection("nope", 5, 3, "auto", 5, "", "text", 0.1, "reference", False))
    with pytest.raises(ValueError, match="gae, grpo, mc_macro, reinforce, rloo"):
        advantages.estimator_class("ppo")


def test_sections_take_their_flags_and_declare_no_defaults():
    """Each part gets its own section of the flat flags; a section has no defaults of its own to disagree with
    the flags' (the rollout's KL coefficient was once 0.1 there and 0.05 on the command line)."""
    import dataclasses

    from marlhf.config import EngineSection
    from marlhf.data.pipeline import DataSection
    from marlhf.eval.generate_tool import PromptSource
    from marlhf.loop import LoopSection
    from marlhf.rlhf.rlhf_engine import ModelsSection
    from marlhf.rlhf.sections import BatchSection, EvalSection, RolloutSection, UpdateSection
    from marlhf.rlhf.trainer import MAPPOSections
    from marlhf.supervised import SupervisedSection

    sections = (MacroSection, RolloutSection, UpdateSection, EngineSection, DataSection, LoopSection, ModelsSection,
                BatchSection, EvalSection, MAPPOSections, SupervisedSection, PromptSource)
    for section in sections:
        assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   for f in dataclasses.fields(section)), section
    args, _ = parse_args(RLHFArgs, ["--actor_learning_rate", "3e-5", "--actor_zero_stage", "2", "--critic_weight_decay",
                                    "0.1", "--kl_ctl", "0.2", "--ngram", "inf", "--macro_reward", "compat",
                                    "--ppo_epochs", "2", "--lam", "0.9"])
    actor, critic = args.engine("actor"), args.engine("critic")
    assert (actor.stage, actor.learning_rate, actor.zero_stage, actor.weight_decay) == ("actor", 3e-5, 2, 0.0)
    assert (critic.stage, critic.weight_decay, critic.zero_stage) == ("critic", 0.1, args.critic_zero_stage)
    rollout, update, macro = (RolloutSection.from_args(args), UpdateSection.from_args(args),
                              MacroSection.from_args(args, "code"))
    assert rollout.policy == update.policy and rollout.policy.kl_ctl == 0.2
    assert rollout.lam == 0.9 and update.batches.ppo_epochs == 2
    assert macro.ngram is None and macro.split_last and macro.termination_condition == "fixed"
    assert macro.response_kind == "code"  # the run's resolved kind, not the flag's "auto"
    # step 3's batches, models and evaluation, and the whole of MA-PPO's sections, from the same flags
    args, _ = parse_args(RLHFArgs, ["--per_device_generation_batch_size", "4", "--num_samples_per_prompt", "2",
                                    "--advantage_estimator", "rloo", "--per_device_training_batch_size", "8",
                                    "--lora_dim", "4", "--max_prompt_seq_len", "100", "--max_answer_seq_len", "20",
                                    "--enable_hybrid_engine", "--print_answers", "--print_answers_interval", "5"])
    batches = BatchSection.from_args(args)
    assert (batches.experiences_per_batch, batches.training_batch) == (8, 8)
    models = ModelsSection.from_args(args, actor_path="a", critic_path="c", reward_path=None,
                                     end_of_conversation_token="<e>")
    assert (models.needs_critic, models.actor_lora_dim, models.critic_lora_dim, models.max_out_tokens) == \
        (False, 4, 0, 120)  # rloo trains no critic; the actor's LoRA rank falls back to --lora_dim
    mappo = MAPPOSections.from_args(args, response_kind="text", stop_ids=[7], pad_id=0)
    assert mappo.print_answers_interval == 5 and mappo.generation.stop_ids == (7,)
    assert mappo.rollout.policy is mappo.update.policy  # the policy's temperature and KL: one section, shared
    assert mappo.update.batches is mappo.batches  # the epochs, micro-batch and accumulation: declared once
    assert EvalSection.from_args(args).batch == 4  # --per_device_eval_generation_batch_size 0: the training one
    assert LoopSection.from_args(args).tensorboard_path == "./output/tensorboard"
    data = DataSection.from_args(args)
    assert (data.max_seq_len, data.max_prompt_seq_len, data.data_path) == (0, 100, ("synthetic",))
    defaults, _ = parse_args(RLHFArgs, [])
    assert RolloutSection.from_args(defaults).policy.kl_ctl == dataclasses.fields(RLHFArgs)[
        [f.name for f in dataclasses.fields(RLHFArgs)].index("kl_ctl")].default
    with pytest.raises(ValueError, match="actor and a critic"):
        args.engine("reward")
