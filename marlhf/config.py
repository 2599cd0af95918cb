"""One documented config per stage, sharing a base — and one parser that turns them into CLI flags.

Field names are DeepSpeed-Chat's flag names, so its launch scripts (and the released MA-RLHF ones) work
unchanged.  Each field's ``help`` is its documentation; :func:`parse_args` builds an ``argparse`` parser
from the dataclass, merges an optional ``--config file.{json,yaml}`` under the command line, adds
DeepSpeed's own ``--deepspeed``/``--deepspeed_config`` flags, and validates everything in one place
(:meth:`BaseArgs.validate`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from marlhf.errors import ConfigError
from marlhf.tasks import TaskNames


def opt(default, help: str, choices=None, aliases=()):  # noqa: A002 - mirrors argparse's name
    """A dataclass field carrying its CLI help text (and optional choices / extra flag spellings)."""
    kwargs = {"default_factory": (lambda: list(default))} if isinstance(default, list) else {"default": default}
    return field(metadata={"help": help, "choices": choices, "aliases": tuple(aliases)}, **kwargs)


# --help groups the flags in sections: a section starts at the field named here and runs to the next start (a
# subclass's own fields come after its parents', so each class's first new field starts a section)
SECTION_STARTS = {
    "data_path": "data", "num_train_epochs": "optimisation", "local_rank": "DeepSpeed / precision",
    "memory_check": "memory plan", "lora_dim": "LoRA", "output_dir": "output / logging",
    "loss_aggregation": "robustness",
    "model_name_or_path": "model and batches", "label_smoothing": "reward model",
    "ref_model_name_or_path": "reference model", "beta": "DPO loss",
    "actor_model_name_or_path": "models", "per_device_generation_batch_size": "batches and lengths",
    "actor_learning_rate": "actor and critic engines", "enable_hybrid_engine": "generation engine",
    "enable_ema": "EMA and per-model LoRA", "kl_ctl": "PPO, sampling and macro actions",
    "reward_source": "reward source", "advantage_estimator": "advantage estimator",
}



def component_names(package: str) -> tuple[str, ...]:
    """The components of a registry package (the termination rules, the advantage estimators): one module per
    component, named as it — listed without importing them, so that ``--help`` needs no torch."""
    import importlib.util
    import pkgutil

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


@dataclass(frozen=True)
class EngineSection:
    """One trained model's DeepSpeed engine (:func:`marlhf.utils.ds_engine.engine_from_section`): the model's
    optimizer, schedule, ZeRO stage and precision.  Built by the step's flags (``args.engine(role)``): steps 1-2
    read --learning_rate, --zero_stage, ...; step 3's actor / critic read --actor_learning_rate, ... ."""

    stage: str  # sft | reward | dpo | actor | critic: whose default learning rate applies
    learning_rate: float | None  # None: the default for the stage and the model's size
    weight_decay: float
    lora_learning_rate: float
    gradient_accumulation_steps: int
    zero_stage: int
    offload: bool
    dtype: str
    lr_scheduler_type: str
    num_warmup_steps: int
    warmup_ratio: float
    gradient_checkpointing: bool


@dataclass
class BaseArgs:
    """Flags every stage shares: data, DeepSpeed, precision, LoRA, schedule, logging, checkpoints."""

    # --- data -------------------------------------------------------------------------------------------
    data_path: list[str] = opt(["synthetic"], "Datasets: hub names, NAME:LOCAL_PATH, local json/jsonl/parquet "
                               "files with prompt/chosen/rejected, or 'synthetic[:k=v,...]' (the embedded task).")
    task: str = opt("auto", "The task (marlhf/tasks.py, marlhf/applications/<task>/): its response kind, gold scorer "
                    "and evaluation. auto: the task that declares the --data_path datasets (synthetic: the embedded "
                    "task; Dahoas/full-hh-rlhf: dialogue; ...), none when they belong to none (a local file of the "
                    "generic layout); none: no task.", choices=TaskNames())
    data_split: str = opt("2,4,4", "Comma-separated shares of each dataset for step 1 / step 2 / step 3 "
                          "(disjoint, seeded).")
    data_output_path: str = opt("/tmp/data_files", "Where tokenized datasets are cached (keyed by every input "
                                "that changes them).")
    bad_rows: str = opt("error", "A bad input row (missing/empty/mistyped field, over-long prompt): 'error' "
                        "stops with file/row/field, 'skip' drops it and counts it in the log.",
                        choices=("error", "skip"))
    eval_fraction: float = opt(0.05, "Share of training records held out for evaluation when a dataset has no "
                               "test split.")
    max_eval_samples: int = opt(512, "Cap on evaluation examples (0 = no cap).")
    end_of_conversation_token: str = opt("", "Appended to every response; the token that ends an answer in step 3. "
                                         "Default: what the model folder recorded (a model trained here), else "
                                         "the token ending the chat template's assistant turn (chat_template "
                                         "format), else <|endoftext|> when the tokenizer has it, else its EOS.")
    add_eot_token: bool = opt(False, "Add --end_of_conversation_token to the vocabulary as a new special token "
                              "when the tokenizer lacks it (otherwise that is an error).")
    prompt_format: str = opt("auto", "raw: DeepSpeed-Chat's 'Human: ... Assistant:' / 'TL;DR:' text; chat_template: "
                             "records as chat messages in the tokenizer's template; auto: recorded with the model, "
                             "else chat_template for instruct models (EOS ends the template's turn), else raw.",
                             choices=("auto", "raw", "chat_template"))
    long_prompts: str = opt("truncate", "A prompt over the token limit: truncate from the left (the most recent turns "
                            "stay, cut at a turn boundary when possible), skip it (counted in the log), or error.",
                            choices=("truncate", "skip", "error"))
    num_padding_at_beginning: int = opt(1, "Padding tokens the tokenizer puts before the text (OPT: 1). Accepted "
                                        "for DeepSpeed-Chat scripts; scores are read at the last position of the "
                                        "attention mask, which is right whatever precedes the text.")
    # --- optimisation -------------------------------------------------------------------------------------
    num_train_epochs: int = opt(1, "Passes over the training data.")
    max_steps: int = opt(0, "Stop after this many optimizer steps (0 = run all epochs). Handy for smoke runs.")
    lr_scheduler_type: str = opt("cosine", "Learning-rate schedule after warmup.",
                                 choices=("linear", "cosine", "constant", "constant_with_warmup"))
    num_warmup_steps: int = opt(0, "Warmup steps (wins over --warmup_ratio when > 0).")
    warmup_ratio: float = opt(0.0, "Warmup as a fraction of total steps.")
    gradient_accumulation_steps: int = opt(1, "Micro-batches per optimizer step.")
    seed: int = opt(1234, "Seed for data split, sampling order, initialisation and generation.")
    data_seed: int = opt(-1, "Seed of the phase split and held-out slice only (-1 = --seed).  Keep it fixed across "
                         "the three steps and vary --seed to repeat a step with other randomness: a step-3 "
                         "--seed alone would also reshuffle which records are prompts, overlapping step 1's.")
    # --- DeepSpeed / precision ----------------------------------------------------------------------------
    local_rank: int = opt(-1, "Set by the deepspeed launcher.")
    zero_stage: int = opt(0, "ZeRO stage 0-3.", choices=(0, 1, 2, 3))
    offload: bool = opt(False, "Offload optimizer state (and ZeRO-3 params) to CPU (DeepSpeedCPUAdam).")
    dtype: str = opt("fp32", "Training dtype. fp16 needs an accelerator with fp16 loss scaling.",
                     choices=("fp32", "bf16", "fp16"))
    bf16: bool = opt(False, "Same as --dtype bf16 (older launch scripts).")
    attn_implementation: str = opt("auto", "Attention kernel of every model: auto picks per architecture "
                                   "(flash_attention_2 with flash-attn on a GPU in bf16/fp16, else sdpa where the "
                                   "model supports it, else eager: Gemma-2's soft-capped logits), or force one.",
                                   choices=("auto", "sdpa", "flash_attention_2", "eager"))
    # --- memory plan (marlhf/models/memory_plan.py, docs/gpu.md) ------------------------------------------
    memory_check: str = opt("refuse", "The memory plan printed at the start (per-rank model states, activations, "
                            "KV cache, from the model configs): refuse a plan that cannot fit the GPU before "
                            "loading any weight, naming the flags that would fit; warn; or off (no plan).",
                            choices=("refuse", "warn", "off"))
    plan_only: bool = opt(False, "Print the memory plan and exit (no weights loaded; a folder with only "
                          "config.json plans too).")
    plan_world_size: int = opt(0, "Ranks the memory plan divides ZeRO partitions over (0: the launched world).")
    plan_device_memory_gb: float = opt(0.0, "GPU memory (GiB) the plan is checked against (0: this machine's GPU; "
                                       "none: not checked).")
    # --- LoRA ---------------------------------------------------------------------------------------------
    lora_dim: int = opt(0, "LoRA rank; 0 disables LoRA.")
    lora_module_name: str = opt("", "Comma-separated module-name substrings that get LoRA (empty = all linear "
                                "layers of the decoder blocks).")
    only_optimize_lora: bool = opt(False, "Freeze everything but the LoRA weights.")
    lora_learning_rate: float = opt(5e-4, "Learning rate of the LoRA weights.")
    # --- output / logging ---------------------------------------------------------------------------------
    output_dir: str = opt("./output", "Where the final Hugging Face model, logs and checkpoints go.")
    print_loss: bool = opt(False, "Print the loss of every step on rank 0.")
    eval_interval: int = opt(0, "Evaluate every N optimizer steps (0 = only at epoch ends; step 3: before and after).")
    save_steps: int = opt(0, "Save a DeepSpeed checkpoint every N optimizer steps (0 = only at the end).")
    keep_checkpoints: int = opt(2, "How many step checkpoints to keep.")
    resume: bool = opt(False, "Continue from the latest checkpoint in --output_dir/checkpoints.")
    enable_tensorboard: bool = opt(False, "Write TensorBoard event files.")
    tensorboard_path: str = opt("", "TensorBoard directory (default: <output_dir>/tensorboard).")
    disable_progress_bar: bool = opt(False, "No tqdm progress bar (logs still printed).")
    # --- robustness (docs/design.md "One optimizer step") ----------------------------------------------
    loss_aggregation: str = opt("token_mean", "token_mean: each optimizer step averages the loss over every real "
                                "token (pair, for the reward model) of its micro-batches on all ranks, so the "
                                "update does not depend on how the batch is cut; microbatch_mean: the mean of "
                                "per-micro-batch means (DeepSpeed-Chat).", choices=("token_mean", "microbatch_mean"))
    max_skipped_steps: int = opt(10, "Optimizer updates with a non-finite loss or gradient are dropped on every rank; "
                                 "stop after this many consecutive training steps with a dropped update (0 = never).")
    debug: bool = opt(False, "Show Python tracebacks for user errors (bad data, flags, paths) too.")

    @property
    def split_seed(self) -> int:
        """The seed of the phase split and the held-out slice (``--data_seed``, else ``--seed``)."""
        return self.seed if self.data_seed < 0 else self.data_seed

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
class SupervisedArgs(BaseArgs):
    """Steps 1 and 2: one model trained on a supervised objective."""

    STAGE: ClassVar[str] = "sft"  # whose default learning rate applies (EngineSection.stage)

    model_name_or_path: str = opt("", "Hugging Face model name or local folder (default: the embedded tiny "
                                  "model, built on first use).")
    per_device_train_batch_size: int = opt(8, "Micro-batch size per rank for training.")
    per_device_eval_batch_size: int = opt(8, "Micro-batch size per rank for evaluation.")
    max_seq_len: int = opt(512, "Prompt + response tokens; longer responses are truncated; a prompt that leaves no "
                           "room for the response is handled by --long_prompts (truncated to half the length).")
    learning_rate: float | None = opt(None, "Peak learning rate (default: 1e-3 for the embedded tiny model, the "
                                      "paper's Table 5 value for the model's size class otherwise).")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    gradient_checkpointing: bool = opt(False, "Recompute activations in backward to save memory.")
    dropout: float | None = opt(None, "Override the model's dropout probabilities (None keeps the config's).")
    group_by_length: bool = opt(False, "Batch training examples of similar length (sorted within mega-batches of "
                                "50 batches, the batches shuffled): less padding, the same examples per epoch.")

    def validate(self) -> None:
        super().validate()
        _check_offload({"--zero_stage": self.zero_stage} if self.offload else {})

    def engine(self) -> EngineSection:
        """The trained model's engine section."""
        return EngineSection(self.STAGE, self.learning_rate, self.weight_decay, self.lora_learning_rate,
                             self.gradient_accumulation_steps, self.zero_stage, self.offload, self.dtype,
                             self.lr_scheduler_type, self.num_warmup_steps, self.warmup_ratio,
                             self.gradient_checkpointing)


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
class SFTArgs(SupervisedArgs):
    """Step 1: supervised fine-tuning on prompt + chosen response (loss on response tokens only)."""

    prompt_loss: bool = opt(False, "Train (and evaluate the held-out loss) on the prompt's tokens too, as "
                            "DeepSpeed-Chat's step 1 does; off: the loss covers the answer only.")


@dataclass
class RewardArgs(SupervisedArgs):
    """Step 2: reward model = base LM + scalar head, pairwise loss -log σ(r⁺ - r⁻)."""

    STAGE: ClassVar[str] = "reward"

    learning_rate: float | None = opt(None, "Peak learning rate (default: 5e-4 for the embedded tiny model, the "
                                      "paper's Table 5 value for the model's size class otherwise).")
    label_smoothing: float = opt(0.0, "ε of the pairwise loss −(1−ε) log σ(Δ) − ε log σ(−Δ): the share of pairs "
                                 "assumed mislabelled (0 = the plain Bradley–Terry loss).")
    reward_loss: str = opt("last", "Pairwise loss on the final-token scores ('last', the score step 3 uses) or on the "
                           "per-token rewards over the span where chosen and rejected differ ('divergence', "
                           "DeepSpeed-Chat's); accuracy is on the scores either way.", choices=("last", "divergence"))
    likelihood_term: bool = opt(False, "Add α·Σ log p(answer | prompt) to the score, under a next-token head over "
                                "the reward model's hidden states started from the SFT model's (α learnt, from 1): "
                                "the head sees whether each answer token was to be expected, which a score head on "
                                "the last token learns poorly (a replaced fact).  Costs one vocabulary-wide "
                                "projection per answer token when scoring.")
    likelihood_norm: str = opt("sum", "The likelihood term over the answer: 'sum' α·Σ log p (longer answers score "
                               "lower by their length alone), 'mean' α·mean log p (no length bias). A folder's "
                               "term keeps the norm it was trained with.", choices=("sum", "mean"))
    likelihood_scale: float = opt(1.0, "α at the start of a fresh likelihood term (then learnt). With 'mean', the "
                                  "typical answer length gives the term the summed one's weight at that length, "
                                  "without its slope in length.")

    def validate(self) -> None:
        super().validate()
        if (self.likelihood_norm != "sum" or self.likelihood_scale != 1.0) and not self.likelihood_term:
            raise ValueError("--likelihood_norm and --likelihood_scale are for --likelihood_term; add it or drop them")
        if not self.likelihood_scale > 0:
            raise ValueError(f"--likelihood_scale must be > 0, got {self.likelihood_scale}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"--label_smoothing must be in [0, 0.5), got {self.label_smoothing}")


@dataclass
class DPOArgs(SupervisedArgs):
    """Step 2 alternative: DPO / IPO of the SFT policy on the reward model's preference pairs (paper App. C.3)."""

    STAGE: ClassVar[str] = "dpo"

    learning_rate: float | None = opt(None, "Peak learning rate (default: 1e-4 for the embedded tiny model, the "
                                      "paper's C.3 value 2e-7 otherwise).")
    ref_model_name_or_path: str = opt("", "The frozen reference model (default: --model_name_or_path, the SFT "
                                      "model the policy starts from).")
    beta: float = opt(0.1, "β of DPO/IPO: how far the policy may move from the reference (paper C.3: 0.1 on "
                      "TL;DR, 0.01 on HH-RLHF).")
    dpo_loss: str = opt("sigmoid", "sigmoid: DPO's -log σ(β h); ipo: IPO's (h - 1/(2β))², h the chosen-minus-"
                        "rejected log-ratio margin.", choices=("sigmoid", "ipo"))

    def validate(self) -> None:
        super().validate()
        if not self.beta > 0:
            raise ValueError(f"--beta must be > 0, got {self.beta}")


@dataclass
class RLHFArgs(BaseArgs):
    """Step 3: MA-PPO (PPO over macro actions; n = 1 is vanilla PPO, n = ∞ one action per response)."""

    actor_model_name_or_path: str = opt("", "The SFT model (step 1 output).")
    critic_model_name_or_path: str = opt("", "The reward model (step 2 output); also initialises the critic.")
    reward_model_name_or_path: str = opt("", "A different reward model than the critic's init (default: same).")
    unsupervised_dataset_name: str = opt("", "Dataset for the ptx (pre-training) loss; empty disables it.")
    unsup_coef: float = opt(27.8, "Weight of the ptx loss.")
    per_device_generation_batch_size: int = opt(8, "Prompts per rank per generation batch.")
    per_device_eval_generation_batch_size: int = opt(0, "Prompts per rank per batch of the held-out evaluation "
                                                     "(0: --per_device_generation_batch_size). Its answers are "
                                                     "one seeded stream, so runs compared on the same prompts "
                                                     "must use the same value.")
    eval_prompts: str = opt("all", "Which held-out prompts the evaluation answers: all, or one of two interleaved "
                            "halves (validation: the 1st, 3rd, ...; test: the 2nd, 4th, ...), so that settings "
                            "chosen on the validation half are reported on prompts they were not chosen on.",
                            choices=("all", "validation", "test"))
    per_device_training_batch_size: int = opt(8, "Experiences per rank per PPO micro-batch.")
    generation_batches: int = opt(1, "Generation batches collected before each PPO update.")
    ppo_epochs: int = opt(1, "PPO passes over each collected experience batch.")
    max_prompt_seq_len: int = opt(256, "Longer prompts are handled by --long_prompts.")
    max_answer_seq_len: int = opt(256, "Maximum generated tokens.")
    actor_learning_rate: float | None = opt(None, "Actor peak learning rate (default: 1e-4 for the embedded tiny "
                                            "model, the paper's Table 5 value for the model's size otherwise).")
    critic_learning_rate: float | None = opt(None, "Critic peak learning rate (default as for the actor).")
    actor_weight_decay: float = opt(0.0, "Actor AdamW weight decay.")
    critic_weight_decay: float = opt(0.0, "Critic AdamW weight decay.")
    actor_zero_stage: int = opt(0, "ZeRO stage of the actor (and reference).", choices=(0, 1, 2, 3))
    critic_zero_stage: int = opt(0, "ZeRO stage of the critic (and reward model).", choices=(0, 1, 2, 3))
    offload_reference_model: bool = opt(False, "Keep reference/reward parameters offloaded to CPU.")
    actor_gradient_checkpointing: bool = opt(False, "Gradient checkpointing in the actor.")
    critic_gradient_checkpointing: bool = opt(False, "Gradient checkpointing in the critic.")
    actor_dropout: float | None = opt(0.0, "Actor dropout (0 makes PPO ratios exact).")
    critic_dropout: float | None = opt(0.0, "Critic dropout.")
    enable_hybrid_engine: bool = opt(False, "DeepSpeed hybrid engine for generation (GPU only).")
    zero3_generation: str = opt("gather", "ZeRO-3 actor without hybrid engine: gather all parameters once per "
                                "generate call (fast) or fetch them per layer with ranks in step (fits any size).",
                                choices=("gather", "synced"))
    inference_tp_size: int = opt(1, "Hybrid engine tensor-parallel size.")
    tp_gather_partition_size: int = opt(8, "Hybrid engine gather partition size.")
    release_inference_cache: bool = opt(False, "Hybrid engine: free the KV cache after generation.")
    unpin_actor_parameters: bool = opt(False, "Hybrid engine: unpin parameters (ZeRO-3).")
    enable_ema: bool = opt(False, "Keep an exponential moving average of the actor.")
    ema_decay: float = opt(0.992, "EMA decay.")
    enable_mixed_precision_lora: bool = opt(False, "ZeRO-3 keeps the frozen actor weights quantized, LoRA weights "
                                            "train in full precision (needs actor LoRA + ZeRO-3; GPU only).")
    actor_lora_dim: int = opt(0, "Actor LoRA rank (0 = --lora_dim).")
    actor_lora_module_name: str = opt("", "Actor LoRA modules (empty = --lora_module_name).")
    critic_lora_dim: int = opt(0, "Critic LoRA rank.")
    critic_lora_module_name: str = opt("", "Critic LoRA modules.")
    # --- PPO / macro actions ------------------------------------------------------------------------------
    kl_ctl: float = opt(0.05, "β of the per-token KL penalty -β(logπ - logπ_ref).")
    clip_reward_value: float = opt(5.0, "RM scores are clipped to ±this.")
    cliprange: float = opt(0.2, "PPO policy ratio clip ε.")
    cliprange_value: float = opt(0.2, "Value clip around the old values.")
    gamma: float = opt(1.0, "Discount γ between macro steps.")
    lam: float = opt(0.95, "GAE λ (the actor's advantages, and the critic's returns unless --lam_critic).")
    lam_critic: float | None = opt(None, "GAE λ of the critic's returns Q = A + V (VAPO decouples it from the actor's; "
                                   "1 gives Monte-Carlo value targets). None: --lam.")
    adaptive_lam_alpha: float = opt(0.0, "> 0: the actor's λ per answer is 1 - 1/(α·L), L its number of macro actions "
                                    "(VAPO's length-adaptive λ); 0: --lam for every answer.")
    whiten_advantages: bool = opt(False, "Whiten advantages over the batch (breaks batch invariance).")
    temperature: float = opt(0.8, "Sampling temperature.")
    top_k: int = opt(50, "Top-k sampling (0 disables).")
    top_p: float = opt(1.0, "Nucleus sampling.")
    logprob_temperature: str = opt("1", "Temperature T of π = softmax(logits / T) for log π_old, log π, log π_ref and "
                                   "the KL: '1' (raw logits; DeepSpeed-Chat and the MA-RLHF code) or 'sampling' "
                                   "(--temperature: the distribution the answers were sampled from, before "
                                   "top-k / top-p; TRL and OpenRLHF).", choices=("1", "sampling"))
    termination_condition: str = opt("fixed", "Macro-action termination rule ζ (paper §3.2.1): one module each in "
                                     "marlhf/rlhf/termination.", choices=Components("marlhf.rlhf.termination"))
    ngram: str = opt("5", "n of the fixed rule: 1 = vanilla PPO, 0 or inf = one macro action per response.")
    repeat_times: int = opt(3, "Randomized rule: times the length list {2,3,5,10} is repeated.")
    parser_cutoff: int = opt(5, "Parsing rule: a tree node with fewer than C tokens is one macro action.")
    parser_backend: str = opt("auto", "Parsing rule backend.",
                              choices=("auto", "benepar", "spacy", "treesitter", "redbaron"))
    parser_model: str = opt("", "Parsing rule model: a benepar model name (e.g. benepar_en3 in nltk_data) or folder, "
                            "or a spaCy pipeline; empty: the backend's default (benepar: benepar_en3 if "
                            "installed, else the project-built model).")
    response_kind: str = opt("auto", "Parsing rule: responses are natural language or Python code; auto: the "
                             "task's (code for code and synthetic_code), else code with --reward_source "
                             "program_tests, else text.",
                             choices=("auto", "text", "code"))
    lowprob_threshold: float = opt(0.1, "Low-probability rule: a macro action ends at a token whose probability is "
                                   "below this τ (Segmental Advantage Estimation's forking tokens).")
    lowprob_model: str = opt("reference", "Low-probability rule: whose probability — the reference model's or the "
                             "sampling policy's (π_old at --logprob_temperature).", choices=("reference", "policy"))
    value_function: str = opt("equal", "σ weights of token values inside a macro action (paper D.1).",
                              choices=("equal", "unit", "position"))
    macro_reward: str = opt("sum", "Macro reward: 'sum' (paper, ρ = 1) or 'compat' (released code: σ-weighted, "
                            "last token its own macro action).", choices=("sum", "compat"))
    policy_ratio: str = opt("token", "PPO ratio per token with the macro advantage (released code) or per "
                            "macro action exp(Σ Δlogπ) (paper eq.)", choices=("token", "macro"))
    reward_source: str = opt("reward_model", "Where the sequence score comes from (marlhf/rewards/): the reward "
                             "model ('rm' is the same); the embedded task's gold scorer; program_tests: each "
                             "answer's program run against its problem's unit tests in a sandbox, reward of paper "
                             "App. B.5; python: your function (--reward_function); remote: your HTTP server "
                             "(--reward_url). The last three need no reward model: the critic starts from the "
                             "actor unless --critic_model_name_or_path is given.",
                             choices=("reward_model", "rm", "gold", "program_tests", "python", "remote"))
    reward_ensemble: list[str] = opt([], "More reward models (step-2 outputs, e.g. other seeds) scoring beside the "
                                     "main one (--reward_model_name_or_path, else the critic's init); the reward is "
                                     "their --reward_ensemble_reduce (a conservative reward against over-"
                                     "optimisation, Coste et al. 2023). The held-out evaluation reports it as "
                                     "ensemble_score beside the main model's rm_score.")
    reward_ensemble_reduce: str = opt("mean_minus_std", "How --reward_ensemble's scores combine: mean_minus_std "
                                      "(mean - --reward_ensemble_std_coef x std over the models), mean, or min.",
                                      choices=("mean_minus_std", "mean", "min"))
    reward_ensemble_std_coef: float = opt(1.0, "k of mean_minus_std.")
    reward_workers: int = opt(1, "program_tests: worker processes running the programs of a batch in parallel "
                              "(results do not depend on it).")
    reward_function: str = opt("", "python: the reward function, FILE.py:NAME (a path from the working directory) "
                               "or package.module:NAME; called once per batch of each rank as NAME(prompts=[str], "
                               "responses=[str], meta=[dict]) — plus ended=[bool] (answer stopped at the end token) "
                               "when it has an 'ended' parameter or **kwargs — it returns one number per "
                               "response; an exception, a wrong count, nan or inf stops the run.")
    reward_url: str = opt("", "remote: the reward server's http(s) URL; each batch of each rank is one POST of "
                          "JSON {\"prompts\", \"responses\", \"meta\", \"ended\"}, answered by "
                          "{\"rewards\": [...]}, one number per response (OpenRLHF's remote reward shape).")
    reward_timeout: float = opt(60.0, "remote: seconds each attempt waits for the server (connection and each read).")
    reward_retries: int = opt(3, "remote: retries after a connection error, a timeout or an HTTP 5xx, waiting 1, 2, "
                              "4, ... s before each; an HTTP 4xx or a malformed answer stops the run at once.")
    print_answers: bool = opt(False, "Print a sample prompt/answer every --print_answers_interval steps.")
    print_answers_interval: int = opt(1, "Steps between printed answers.")
    # --- advantage estimator (issue 11; marlhf/rlhf/estimators.py says which combinations are meaningful) ---
    advantage_estimator: str = opt("gae", "gae: macro GAE with a critic (MA-PPO); rloo: leave-one-out baseline over "
                                   "the K samples of a prompt; grpo: (R - mean) / std over them; reinforce: batch-mean "
                                   "baseline (these three treat the response as one action); mc_macro: macro "
                                   "advantages on Monte-Carlo values of each macro boundary (--mc_rollouts). None "
                                   "but gae builds a critic (one module each in marlhf/rlhf/advantages).",
                                   choices=Components("marlhf.rlhf.advantages"))
    num_samples_per_prompt: int = opt(1, "K answers sampled per prompt (a group: generated, scored and given "
                                      "advantages together on one rank); --per_device_generation_batch_size counts "
                                      "prompts, so a generation batch holds that many x K experiences.")
    mc_rollouts: int = opt(4, "mc_macro: continuations sampled with the current policy from each macro action's start "
                           "state; their mean score is its Monte-Carlo value (VinePPO). Costs that many extra "
                           "answers per macro action.")
    critic_mc_check: int = opt(0, "> 0: with a critic (gae), sample that many continuations from every macro boundary "
                               "each step and log how well the critic's V(s_k) agrees with their mean score "
                               "(train/critic_mc_corr, train/critic_mc_rmse; VinePPO's diagnostic). Costs that many "
                               "extra answers per macro action; 0: off.")
    grpo_normalization: str = opt("std", "grpo: divide the centred group returns by the group's std (GRPO), or not "
                                  "('none': Dr. GRPO, Liu et al. 2025).", choices=("std", "none"))
    kl_penalty: str = opt("reward", "The β = --kl_ctl KL penalty: per token in the reward (-β(logπ - logπ_ref), "
                          "DeepSpeed-Chat / the paper), or as a loss term β·KL (k3 estimator per token, GRPO).",
                          choices=("reward", "loss"))

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
        return EngineSection(role, getattr(self, f"{role}_learning_rate"), getattr(self, f"{role}_weight_decay"),
                             self.lora_learning_rate, self.gradient_accumulation_steps,
                             getattr(self, f"{role}_zero_stage"), self.offload, self.dtype, self.lr_scheduler_type,
                             self.num_warmup_steps, self.warmup_ratio, getattr(self, f"{role}_gradient_checkpointing"))

    def validate_estimator(self) -> None:
        """--advantage_estimator with the MA-PPO options: the meaningful combinations only (ConfigError)."""

        defaults = {f.name: f.default for f in dataclasses.fields(RLHFArgs)}
        # torch: imported to validate, not for --help
        from marlhf.rlhf.advantages import EstimatorOptions, check_estimator_options

        check_estimator_options(EstimatorOptions(
            estimator=self.advantage_estimator, num_samples_per_prompt=self.num_samples_per_prompt,
            kl_penalty=self.kl_penalty, grpo_normalization=self.grpo_normalization, policy_ratio=self.policy_ratio,
            termination_changed=(self.termination_condition != defaults["termination_condition"]
                                 or self.ngram_n != RLHFArgs(ngram=defaults["ngram"]).ngram_n),
            value_function=self.value_function, macro_reward=self.macro_reward, gamma=self.gamma,
            lam_changed=(self.lam != defaults["lam"] or self.lam_critic is not None or self.adaptive_lam_alpha != 0),
            whiten_advantages=self.whiten_advantages))

    @property
    def ngram_n(self) -> int | None:
        """--ngram as an int, None meaning ∞ (one macro action per response)."""
        text = str(self.ngram).strip().lower()
        if text in ("0", "inf", "infinity", "none"):
            return None
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"--ngram must be a positive integer, 0 or inf, got {self.ngram!r}")
        return int(text)


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


@dataclass
class PolicyEvalArgs(RLHFArgs):
    """Held-out evaluation of any trained policy (SFT, DPO, a step-3 actor) exactly as step 3 evaluates its
    actor: the same prompts (--data_path, --data_seed, --max_eval_samples), sampling settings and scores."""

    ref_model_name_or_path: str = opt("", "Reference policy of the held-out KL (e.g. the SFT model); empty: "
                                      "no KL.")


# --------------------------------------------------------------------------------------------------------
# dataclass -> argparse
# --------------------------------------------------------------------------------------------------------
def _base_type(annotation):
    """(python type, is_list, is_optional) of an annotation such as ``float | None`` or ``list[str]``."""
    hint, optional = annotation, False
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint, origin, optional = args[0], typing.get_origin(args[0]), True
    if origin is list:
        return typing.get_args(hint)[0], True, optional
    return hint, False, optional


def build_parser(cls: type[BaseArgs], description: str = "") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description or cls.__doc__, usage="%(prog)s [flags]",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", type=str, default=None,
                        help="JSON or YAML file of flag values; the command line overrides it.")
    hints = typing.get_type_hints(cls)
    group = parser
    for f in dataclasses.fields(cls):
        if f.name in SECTION_STARTS:
            group = parser.add_argument_group(SECTION_STARTS[f.name])
        meta = f.metadata
        typ, is_list, optional = _base_type(hints[f.name])
        names = [f"--{f.name}", *meta.get("aliases", ())]
        kwargs = {"help": meta.get("help", ""), "dest": f.name}
        if typ is bool:
            group.add_argument(*names, action="store_true", **kwargs)
            continue
        kwargs["type"] = _none_or(typ) if optional else typ
        if is_list:
            kwargs["nargs"] = "+"
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
        group.add_argument(*names, **kwargs)
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


def _none_or(typ):
    def convert(text: str):
        return None if text.lower() == "none" else typ(text)

    convert.__name__ = typ.__name__
    return convert


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
