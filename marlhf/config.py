"""Each stage's flat flags, generated from its sections — and one parser that turns them into CLI flags.

Every flag is declared once, in the section that reads it (:mod:`marlhf.sections`, :mod:`marlhf.rlhf.sections`);
a stage's class here lists its sections (:func:`~marlhf.utils.flags.flat_flags`), so its field names are
DeepSpeed-Chat's flat flag names and its launch scripts (and the released MA-RLHF ones) work unchanged.
:func:`parse_args` builds an ``argparse`` parser from the class (one ``--help`` group per section), merges an
optional ``--config file.{json,yaml}`` under the command line, adds DeepSpeed's own
``--deepspeed``/``--deepspeed_config`` flags, and validates the combinations in one place (``validate``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from marlhf.errors import ConfigError
from marlhf.rlhf.sections import STEP3_SECTIONS, ngram_value
from marlhf.sections import (
    BASE_SECTIONS,
    DPOSection,
    EngineSection,
    GenerationEngineSection,
    HeldOutReferenceSection,
    RewardModelSection,
    SamplingSection,
    SFTSection,
    SupervisedSection,
    split_seed,
)
from marlhf.utils.flags import add_argument, flat_flags


@dataclass
@flat_flags(*BASE_SECTIONS)
class BaseArgs:
    """Flags every stage shares: data, schedule, DeepSpeed, precision, memory plan, LoRA, logging, robustness."""

    @property
    def split_seed(self) -> int:
        """The seed of the phase split and the held-out slice (``--data_seed``, else ``--seed``)."""
        return split_seed(self.data_seed, self.seed)

    def validate(self) -> None:
        """Check cross-field constraints once, so the training code can trust its config."""
        if self.bf16:
            self.dtype = "bf16"
        shares = self.data_split.split(",")
        if len(shares) != 3 or not all(_is_number(s) and float(s) >= 0 for s in shares) \
                or sum(float(s) for s in shares) <= 0:
            raise ValueError(f"--data_split must be three non-negative numbers like 2,4,4, got {self.data_split!r}")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"--eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.gradient_accumulation_steps < 1:
            raise ValueError("--gradient_accumulation_steps must be >= 1")
        lora = max(self.lora_dim, getattr(self, "actor_lora_dim", 0), getattr(self, "critic_lora_dim", 0))
        if self.only_optimize_lora and lora <= 0:
            raise ValueError("--only_optimize_lora needs LoRA (--lora_dim, or step 3's --actor_lora_dim / "
                             "--critic_lora_dim, > 0)")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"--warmup_ratio must be in [0, 1), got {self.warmup_ratio}")


@dataclass
@flat_flags(SupervisedSection)
class SupervisedArgs(BaseArgs):
    """Steps 1 and 2: one model trained on a supervised objective."""

    STAGE: ClassVar[str] = "sft"  # whose default learning rate applies (EngineSection.stage)

    def validate(self) -> None:
        super().validate()
        _check_offload({"--zero_stage": self.zero_stage} if self.offload else {})

    def engine(self) -> EngineSection:
        """The trained model's engine section."""
        return EngineSection.build(self, stage=self.STAGE, learning_rate=self.learning_rate,
                                   weight_decay=self.weight_decay, zero_stage=self.zero_stage,
                                   gradient_checkpointing=self.gradient_checkpointing)


def _check_offload(stages: dict[str, int]) -> None:
    """``--offload`` is ZeRO-Offload: DeepSpeed moves the optimizer state to the CPU at stages 1-3 only.  At
    stage 0 it leaves the parameters and gradients on the GPU, where DeepSpeedCPUAdam cannot update them (an
    assertion at the first step on a GPU node), so the combination is refused for each engine it would reach."""
    zero = [flag for flag, stage in stages.items() if stage == 0]
    if zero:
        raise ValueError(f"--offload needs ZeRO stage 1, 2 or 3 for every engine it offloads; {' and '.join(zero)} "
                         f"{'is' if len(zero) == 1 else 'are'} 0 (DeepSpeed offloads optimizer state from stage 1, "
                         f"parameters at stage 3): set {' and '.join(f'{f} 2' for f in zero)} (or 3)")


@dataclass
@flat_flags(SFTSection)
class SFTArgs(SupervisedArgs):
    """Step 1: supervised fine-tuning on prompt + chosen response (loss on response tokens only)."""


@dataclass
@flat_flags(RewardModelSection)
class RewardArgs(SupervisedArgs):
    """Step 2: reward model = base LM + scalar head, pairwise loss -log σ(r⁺ - r⁻)."""

    STAGE: ClassVar[str] = "reward"

    def validate(self) -> None:
        super().validate()
        if (self.likelihood_norm != "sum" or self.likelihood_scale != 1.0) and not self.likelihood_term:
            raise ValueError("--likelihood_norm and --likelihood_scale are for --likelihood_term; add it or drop them")
        if not self.likelihood_scale > 0:
            raise ValueError(f"--likelihood_scale must be > 0, got {self.likelihood_scale}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"--label_smoothing must be in [0, 0.5), got {self.label_smoothing}")


@dataclass
@flat_flags(DPOSection)
class DPOArgs(SupervisedArgs):
    """Step 2 alternative: DPO / IPO of the SFT policy on the reward model's preference pairs (paper App. C.3)."""

    STAGE: ClassVar[str] = "dpo"

    def validate(self) -> None:
        super().validate()
        if not self.beta > 0:
            raise ValueError(f"--beta must be > 0, got {self.beta}")


@dataclass
@flat_flags(SamplingSection, GenerationEngineSection, *STEP3_SECTIONS)
class RLHFArgs(BaseArgs):
    """Step 3: MA-PPO (PPO over macro actions; n = 1 is vanilla PPO, n = ∞ one action per response)."""

    def validate(self) -> None:
        super().validate()
        _ = self.ngram_n  # raises on a bad --ngram
        if self.lam_critic is not None and not 0 <= self.lam_critic <= 1:
            raise ValueError(f"--lam_critic must be in [0, 1], got {self.lam_critic}")
        if self.adaptive_lam_alpha < 0:
            raise ValueError(f"--adaptive_lam_alpha must be >= 0 (0: off), got {self.adaptive_lam_alpha}")
        if not 0 < self.lowprob_threshold < 1:
            raise ValueError(f"--lowprob_threshold must be in (0, 1), got {self.lowprob_threshold}")
        if self.reward_source == "rm":
            self.reward_source = "reward_model"
        if self.critic_mc_check < 0:
            raise ValueError(f"--critic_mc_check must be >= 0 (0: off), got {self.critic_mc_check}")
        if self.mc_rollouts < 1:
            raise ValueError(f"--mc_rollouts must be >= 1, got {self.mc_rollouts}")
        if self.reward_workers < 1:
            raise ValueError(f"--reward_workers must be >= 1, got {self.reward_workers}")
        self.validate_reward_flags()
        self.validate_estimator()
        self.validate_generation_engine()
        if self.offload:  # the actor, and the critic where the estimator trains one
            from marlhf.rlhf.advantages import estimator_class

            stages = {"--actor_zero_stage": self.actor_zero_stage}
            if estimator_class(self.advantage_estimator).needs_critic:
                stages["--critic_zero_stage"] = self.critic_zero_stage
            _check_offload(stages)
        gen_rows = self.per_device_generation_batch_size * self.num_samples_per_prompt  # experiences per batch
        if self.per_device_training_batch_size > gen_rows * self.generation_batches:
            raise ValueError("--per_device_training_batch_size cannot exceed the experiences collected per update "
                             "(--per_device_generation_batch_size x --num_samples_per_prompt x --generation_batches)")
        if self.loss_aggregation == "token_mean" and self.gradient_accumulation_steps > 1:
            micro = math.ceil(gen_rows / self.per_device_training_batch_size)
            micro *= self.generation_batches * self.ppo_epochs
            if micro % self.gradient_accumulation_steps:
                raise ValueError(f"--loss_aggregation token_mean needs each PPO update's {micro} micro-batches to "
                                 f"fill whole windows of --gradient_accumulation_steps "
                                 f"{self.gradient_accumulation_steps} (a token mean over a window that spans two "
                                 f"updates cannot be known in advance); change the batch sizes or use "
                                 f"--loss_aggregation microbatch_mean")

    def validate_reward_flags(self) -> None:
        """The user's reward's flags: given with their source only, and well-formed (ConfigError).  A python
        spec's module is imported when the source is built (marlhf.rewards.build_reward_source)."""

        defaults = {f.name: f.default for f in dataclasses.fields(RLHFArgs)}
        for flag, source in (("reward_function", "python"), ("reward_url", "remote"), ("reward_timeout", "remote"),
                             ("reward_retries", "remote")):
            if getattr(self, flag) != defaults[flag] and self.reward_source != source:
                raise ConfigError(f"--{flag} is for --reward_source {source}, not {self.reward_source}")
        if self.reward_ensemble and self.reward_source != "reward_model":
            raise ConfigError(f"--reward_ensemble combines reward models: it needs --reward_source reward_model, "
                              f"not {self.reward_source}")
        for flag in ("reward_ensemble_reduce", "reward_ensemble_std_coef"):
            if getattr(self, flag) != defaults[flag] and not self.reward_ensemble:
                raise ConfigError(f"--{flag} needs --reward_ensemble (the other reward models to combine)")
        if not (self.reward_ensemble_std_coef >= 0 and math.isfinite(self.reward_ensemble_std_coef)):
            raise ConfigError(f"--reward_ensemble_std_coef must be a finite number >= 0, got "
                              f"{self.reward_ensemble_std_coef}")
        if self.reward_source == "python":
            if not self.reward_function:
                raise ConfigError("--reward_source python needs --reward_function FILE.py:NAME or "
                                  "package.module:NAME")
            from marlhf.rewards.python import check_function_spec

            check_function_spec(self.reward_function)
        if self.reward_source == "remote":
            if not self.reward_url:
                raise ConfigError("--reward_source remote needs --reward_url http(s)://HOST[:PORT]/PATH")
            from marlhf.rewards.remote import check_url

            check_url(self.reward_url)
            if not (self.reward_timeout > 0 and math.isfinite(self.reward_timeout)):
                raise ConfigError(f"--reward_timeout must be a positive number of seconds, got {self.reward_timeout}")
            if self.reward_retries < 0:
                raise ConfigError(f"--reward_retries must be >= 0, got {self.reward_retries}")

    def engine(self, role: str) -> EngineSection:
        """The ``actor`` or ``critic`` engine section (--actor_learning_rate, --actor_zero_stage, ...)."""
        if role not in ("actor", "critic"):
            raise ValueError(f"step 3 trains an actor and a critic, not {role!r}")
        return EngineSection.build(self, stage=role, learning_rate=getattr(self, f"{role}_learning_rate"),
                                   weight_decay=getattr(self, f"{role}_weight_decay"),
                                   zero_stage=getattr(self, f"{role}_zero_stage"),
                                   gradient_checkpointing=getattr(self, f"{role}_gradient_checkpointing"))

    def validate_generation_engine(self) -> None:
        """--generation_backend and its options, checked before any model loads (ConfigError)."""
        import torch  # imported to validate, not for --help

        GenerationEngineSection.build(self).check(on_gpu=torch.cuda.is_available())
        if self.vllm_tis_cap != 0:
            if self.generation_backend != "vllm":
                raise ConfigError("--vllm_tis_cap corrects for a generation engine's sampling: it needs "
                                  "--generation_backend vllm")
            if not self.vllm_tis_cap > 0:
                raise ConfigError(f"--vllm_tis_cap must be > 0 (0: off), got {self.vllm_tis_cap}")
            if self.logprob_temperature != "1":
                raise ConfigError("--vllm_tis_cap compares π_old with the engine's raw log-probabilities: it needs "
                                  "--logprob_temperature 1")
        if self.generation_backend != "vllm":
            return
        from marlhf.vllm_sampler import require_vllm

        require_vllm()
        if self.enable_hybrid_engine:
            raise ConfigError("--enable_hybrid_engine and --generation_backend vllm both generate: choose one "
                              "(vllm runs today's models; the hybrid engine cannot)")
        if self.add_eot_token:
            raise ConfigError("--generation_backend vllm loads the actor's folder as saved, so its vocabulary "
                              "cannot grow with --add_eot_token: add the token in step 1 (the actor then has it)")

    def validate_estimator(self) -> None:
        """--advantage_estimator with the MA-PPO options: the meaningful combinations only (ConfigError)."""

        defaults = {f.name: f.default for f in dataclasses.fields(RLHFArgs)}
        # torch: imported to validate, not for --help
        from marlhf.rlhf.advantages import EstimatorOptions, check_estimator_options

        check_estimator_options(EstimatorOptions(
            estimator=self.advantage_estimator, num_samples_per_prompt=self.num_samples_per_prompt,
            kl_penalty=self.kl_penalty, grpo_normalization=self.grpo_normalization, policy_ratio=self.policy_ratio,
            termination_changed=(self.termination_condition != defaults["termination_condition"]
                                 or self.ngram_n != ngram_value(defaults["ngram"])),
            value_function=self.value_function, macro_reward=self.macro_reward, gamma=self.gamma,
            lam_changed=(self.lam != defaults["lam"] or self.lam_critic is not None or self.adaptive_lam_alpha != 0),
            whiten_advantages=self.whiten_advantages))

    @property
    def ngram_n(self) -> int | None:
        """--ngram as an int, None meaning ∞ (one macro action per response)."""
        return ngram_value(self.ngram)


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


@dataclass
@flat_flags(HeldOutReferenceSection)
class PolicyEvalArgs(RLHFArgs):
    """Held-out evaluation of any trained policy (SFT, DPO, a step-3 actor) exactly as step 3 evaluates its
    actor: the same prompts (--data_path, --data_seed, --max_eval_samples), sampling settings and scores."""


# --------------------------------------------------------------------------------------------------------
# dataclass -> argparse
# --------------------------------------------------------------------------------------------------------
def build_parser(cls: type[BaseArgs], description: str = "") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description or cls.__doc__, usage="%(prog)s [flags]",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", type=str, default=None,
                        help="JSON or YAML file of flag values; the command line overrides it.")
    hints = typing.get_type_hints(cls)
    groups = {}
    for f in dataclasses.fields(cls):
        title = f.metadata.get("group", "")
        if title not in groups:
            groups[title] = parser.add_argument_group(title) if title else parser
        add_argument(groups[title], f.name, hints[f.name], f.metadata.get("help", ""), f.metadata.get("choices"),
                     f.metadata.get("aliases", ()))
    parser.set_defaults(**{f.name: _default(f) for f in dataclasses.fields(cls)})
    # DeepSpeed's own flags, as DeepSpeed-Chat's scripts pass them: the four deepspeed.add_config_arguments adds,
    # declared here because importing deepspeed (and torch with it) cost --help 2-3 s (tests/test_cli.py)
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def _default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def load_config_file(path: str) -> dict:
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of flag names to values")
    return data


def parse_args(cls: type[BaseArgs], argv: list[str] | None = None):
    """Parse the command line (plus an optional --config file) into a validated ``cls`` instance.

    Returns ``(args, namespace)``: the typed config, and the raw namespace holding DeepSpeed's extra flags.
    """

    try:
        return _parse_args(cls, argv)
    except (ValueError, OSError) as err:  # bad values / combinations, unreadable --config: the user's to fix
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(str(err)) from err


def _parse_args(cls: type[BaseArgs], argv: list[str] | None):
    parser = build_parser(cls)
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        values = load_config_file(pre.config)
        values.pop("run_context", None)  # a run's args.json: what it resolved is not a flag
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{pre.config}: unknown keys {unknown}")
        parser.set_defaults(**values)
    ns = parser.parse_args(argv)
    args = cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})
    args.validate()
    return args, ns
