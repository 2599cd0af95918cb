"""The sections every stage shares — each flag declared once, here, in the section that reads it.

A stage's flat flags (:mod:`marlhf.config`) are generated from these sections and step 3's
(:mod:`marlhf.rlhf.sections`); each part of the system is handed its own section, built from the parsed flags by
:meth:`~marlhf.utils.flags.Section.build`.  Torch-free: ``--help`` imports this module.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from marlhf.tasks import TaskNames
from marlhf.utils.flags import Section, derived, flag

PROMPT_FORMATS = ("auto", "raw", "chat_template")


def split_seed(data_seed: int, seed: int) -> int:
    """The seed of the phase split and the held-out slice: ``--data_seed``, else ``--seed``."""
    return seed if data_seed < 0 else data_seed


@dataclass(frozen=True, kw_only=True)
class ScheduleSection(Section):
    """How long a stage trains and how each optimizer step is made: epochs, steps, accumulation, the learning-rate
    schedule and the seed of the run's randomness."""

    TITLE = "optimisation"

    num_train_epochs: int = flag(1, "Passes over the training data.")
    max_steps: int = flag(0, "Stop after this many optimizer steps (0 = run all epochs). Handy for smoke runs.")
    lr_scheduler_type: str = flag("cosine", "Learning-rate schedule after warmup.",
                                  choices=("linear", "cosine", "constant", "constant_with_warmup"))
    num_warmup_steps: int = flag(0, "Warmup steps (wins over --warmup_ratio when > 0).")
    warmup_ratio: float = flag(0.0, "Warmup as a fraction of total steps.")
    gradient_accumulation_steps: int = flag(1, "Micro-batches per optimizer step.")
    seed: int = flag(1234, "Seed for data split, sampling order, initialisation and generation.")


@dataclass(frozen=True, kw_only=True)
class DataSection(Section):
    """What a step's data is (:func:`marlhf.data.pipeline.build_phase_data`): the datasets and their split, the
    held-out slice, the length rules, and the conversation format in force (the end token and prompt format the
    run resolved are given to :meth:`build`; the flags' values otherwise)."""

    TITLE = "data"

    data_path: tuple[str, ...] = flag(["synthetic"], "Datasets: hub names, NAME:LOCAL_PATH, local json/jsonl/parquet "
                                      "files with prompt/chosen/rejected, or 'synthetic[:k=v,...]' (the embedded "
                                      "task).")
    task: str = flag("auto", "The task (marlhf/tasks.py, marlhf/applications/<task>/): its response kind, gold "
                     "scorer and evaluation. auto: the task that declares the --data_path datasets (synthetic: the "
                     "embedded task; Dahoas/full-hh-rlhf: dialogue; ...), none when they belong to none (a local "
                     "file of the generic layout); none: no task.", choices=TaskNames())
    data_split: str = flag("2,4,4", "Comma-separated shares of each dataset for step 1 / step 2 / step 3 "
                           "(disjoint, seeded).")
    data_output_path: str = flag("/tmp/data_files", "Where tokenized datasets are cached (keyed by every input "
                                 "that changes them).")
    bad_rows: str = flag("error", "A bad input row (missing/empty/mistyped field, over-long prompt): 'error' "
                         "stops with file/row/field, 'skip' drops it and counts it in the log.",
                         choices=("error", "skip"))
    eval_fraction: float = flag(0.05, "Share of training records held out for evaluation when a dataset has no "
                                "test split.")
    max_eval_samples: int = flag(512, "Cap on evaluation examples (0 = no cap).")
    split_seed: int = flag(-1, "Seed of the phase split and held-out slice only (-1 = --seed).  Keep it fixed across "
                           "the three steps and vary --seed to repeat a step with other randomness: a step-3 "
                           "--seed alone would also reshuffle which records are prompts, overlapping step 1's.",
                           name="data_seed", type=int, parse=lambda v, a: split_seed(v, a.seed))
    end_of_conversation_token: str = flag("", "Appended to every response; the token that ends an answer in step 3. "
                                          "Default: what the model folder recorded (a model trained here), else "
                                          "the token ending the chat template's assistant turn (chat_template "
                                          "format), else <|endoftext|> when the tokenizer has it, else its EOS.",
                                          resolved=True)
    add_eot_token: bool = flag(False, "Add --end_of_conversation_token to the vocabulary as a new special token "
                               "when the tokenizer lacks it (otherwise that is an error).")
    prompt_format: str = flag("auto", "raw: DeepSpeed-Chat's 'Human: ... Assistant:' / 'TL;DR:' text; chat_template: "
                              "records as chat messages in the tokenizer's template; auto: recorded with the model, "
                              "else chat_template for instruct models (EOS ends the template's turn), else raw.",
                              choices=PROMPT_FORMATS, resolved=True)
    long_prompts: str = flag("truncate", "A prompt over the token limit: truncate from the left (the most recent "
                             "turns stay, cut at a turn boundary when possible), skip it (counted in the log), or "
                             "error.", choices=("truncate", "skip", "error"))
    num_padding_at_beginning: int = flag(1, "Padding tokens the tokenizer puts before the text (OPT: 1). Accepted "
                                         "for DeepSpeed-Chat scripts; scores are read at the last position of the "
                                         "attention mask, which is right whatever precedes the text.")
    # the length limits: steps 1-2's --max_seq_len, step 3's --max_prompt_seq_len
    max_seq_len: int = derived(lambda a: getattr(a, "max_seq_len", 0))  # prompt + response (0 in step 3)
    max_prompt_seq_len: int = derived(lambda a: getattr(a, "max_prompt_seq_len", getattr(a, "max_seq_len", 0)))


@dataclass(frozen=True, kw_only=True)
class PrecisionSection(Section):
    """How every model runs: ZeRO, offload, dtype and the attention kernel (read by the engines and the loaders)."""

    TITLE = "DeepSpeed / precision"

    local_rank: int = flag(-1, "Set by the deepspeed launcher.")
    zero_stage: int = flag(0, "ZeRO stage 0-3.", choices=(0, 1, 2, 3))
    offload: bool = flag(False, "Offload optimizer state (and ZeRO-3 params) to CPU (DeepSpeedCPUAdam).")
    dtype: str = flag("fp32", "Training dtype. fp16 needs an accelerator with fp16 loss scaling.",
                      choices=("fp32", "bf16", "fp16"))
    bf16: bool = flag(False, "Same as --dtype bf16 (older launch scripts).")
    attn_implementation: str = flag("auto", "Attention kernel of every model: auto picks per architecture "
                                    "(flash_attention_2 with flash-attn on a GPU in bf16/fp16, else sdpa where the "
                                    "model supports it, else eager: Gemma-2's soft-capped logits), or force one.",
                                    choices=("auto", "sdpa", "flash_attention_2", "eager"))


@dataclass(frozen=True, kw_only=True)
class MemoryPlanSection(Section):
    """The memory plan printed before any weight loads (:mod:`marlhf.models.memory_plan`, docs/gpu.md)."""

    TITLE = "memory plan"

    memory_check: str = flag("refuse", "The memory plan printed at the start (per-rank model states, activations, "
                             "KV cache, from the model configs): refuse a plan that cannot fit the GPU before "
                             "loading any weight, naming the flags that would fit; warn; or off (no plan).",
                             choices=("refuse", "warn", "off"))
    plan_only: bool = flag(False, "Print the memory plan and exit (no weights loaded; a folder with only "
                           "config.json plans too).")
    plan_world_size: int = flag(0, "Ranks the memory plan divides ZeRO partitions over (0: the launched world).")
    plan_device_memory_gb: float = flag(0.0, "GPU memory (GiB) the plan is checked against (0: this machine's GPU; "
                                        "none: not checked).")


@dataclass(frozen=True, kw_only=True)
class LoRASection(Section):
    """LoRA on the trained models (step 3's per-model ranks fall back to these)."""

    TITLE = "LoRA"

    lora_dim: int = flag(0, "LoRA rank; 0 disables LoRA.")
    lora_module_name: str = flag("", "Comma-separated module-name substrings that get LoRA (empty = all linear "
                                 "layers of the decoder blocks).")
    only_optimize_lora: bool = flag(False, "Freeze everything but the LoRA weights.")
    lora_learning_rate: float = flag(5e-4, "Learning rate of the LoRA weights.")


@dataclass(frozen=True, kw_only=True)
class LoopSection(Section):
    """When the loop (:mod:`marlhf.loop`) evaluates and checkpoints, and where it writes."""

    TITLE = "output / logging"

    output_dir: str = flag("./output", "Where the final Hugging Face model, logs and checkpoints go.")
    print_loss: bool = flag(False, "Print the loss of every step on rank 0.")
    eval_interval: int = flag(0, "Evaluate every N optimizer steps (0 = only at epoch ends; step 3: before and "
                              "after).")
    save_steps: int = flag(0, "Save a DeepSpeed checkpoint every N optimizer steps (0 = only at the end).")
    keep_checkpoints: int = flag(2, "How many step checkpoints to keep.")
    resume: bool = flag(False, "Continue from the latest checkpoint in --output_dir/checkpoints.")
    enable_tensorboard: bool = flag(False, "Write TensorBoard event files.")
    tensorboard_path: str = flag("", "TensorBoard directory (default: <output_dir>/tensorboard).", type=str,
                                 parse=lambda v, a: v or os.path.join(a.output_dir, "tensorboard"))
    disable_progress_bar: bool = flag(False, "No tqdm progress bar (logs still printed).")
    seed: int = derived(lambda a: a.seed)  # the checkpoints' RNG states (ScheduleSection's --seed)


@dataclass(frozen=True, kw_only=True)
class RobustnessSection(Section):
    """How an optimizer step is made robust (docs/design.md "One optimizer step") and how errors are shown."""

    TITLE = "robustness"

    loss_aggregation: str = flag("token_mean", "token_mean: each optimizer step averages the loss over every real "
                                 "token (pair, for the reward model) of its micro-batches on all ranks, so the "
                                 "update does not depend on how the batch is cut; microbatch_mean: the mean of "
                                 "per-micro-batch means (DeepSpeed-Chat).", choices=("token_mean", "microbatch_mean"))
    max_skipped_steps: int = flag(10, "Optimizer updates with a non-finite loss or gradient are dropped on every "
                                  "rank; stop after this many consecutive training steps with a dropped update "
                                  "(0 = never).")
    debug: bool = flag(False, "Show Python tracebacks for user errors (bad data, flags, paths) too.")


BASE_SECTIONS = (DataSection, ScheduleSection, PrecisionSection, MemoryPlanSection, LoRASection, LoopSection,
                 RobustnessSection)  # the flags every stage has


@dataclass(frozen=True, kw_only=True)
class EngineSection(Section):
    """One trained model's DeepSpeed engine (:func:`marlhf.utils.ds_engine.engine_from_section`): its optimizer,
    schedule, ZeRO stage and precision.  The stage's flags say which model's values these are (steps 1-2:
    --learning_rate, --zero_stage, ...; step 3: --actor_learning_rate, --critic_zero_stage, ...), so the entry
    point gives them (``args.engine(role)``)."""

    stage: str = derived()  # sft | reward | dpo | actor | critic: whose default learning rate applies
    learning_rate: float | None = derived()  # None: the default for the stage and the model's size
    weight_decay: float = derived()
    zero_stage: int = derived()
    gradient_checkpointing: bool = derived()
    lora_learning_rate: float = derived(lambda a: a.lora_learning_rate)
    offload: bool = derived(lambda a: a.offload)
    dtype: str = derived(lambda a: a.dtype)
    schedule: ScheduleSection  # accumulation and the learning-rate schedule


@dataclass(frozen=True, kw_only=True)
class SamplingSection(Section):
    """How answers are sampled — step 3's rollouts and held-out evaluation, and the tools (``marlhf generate``,
    ``best-of-n``, ``chat``), one default each (:meth:`generation` gives the sampler's config)."""

    TITLE = "sampling"

    temperature: float = flag(0.8, "Sampling temperature.")
    top_k: int = flag(50, "Top-k sampling (0 disables).")
    top_p: float = flag(1.0, "Nucleus sampling.")
    max_new_tokens: int = flag(256, "Maximum generated tokens.", name="max_answer_seq_len",
                               aliases=("--max_new_tokens",))
    max_prompt_len: int = flag(256, "Longer prompts are handled by --long_prompts (the tools cut them from the "
                               "left).", name="max_prompt_seq_len", aliases=("--max_prompt_len",))

    def generation(self, stop_ids, pad_id: int, seed: int | None = None, do_sample: bool = True):
        """The sampler's :class:`~marlhf.sampler.GenerationConfig` with the run's stop and pad ids."""
        from marlhf.sampler import GenerationConfig  # torch: not for --help

        return GenerationConfig(max_new_tokens=self.max_new_tokens, stop_ids=tuple(stop_ids), pad_id=pad_id,
                                temperature=self.temperature, top_k=self.top_k or 0, top_p=self.top_p,
                                do_sample=do_sample, seed=seed)


@dataclass(frozen=True, kw_only=True)
class GenerationEngineSection(Section):
    """What samples the answers: the policy's own Hugging Face ``generate`` (the default), or a vLLM engine per
    rank colocated with training, the actor's weights pushed into it after every update
    (:mod:`marlhf.vllm_sampler`)."""

    TITLE = "generation engine"

    backend: str = flag("hf", "hf: the actor's own Hugging Face generate; vllm: a vLLM engine per rank (pip install "
                        "'marlhf[vllm]'), the actor's weights pushed into it after every update, π_old still "
                        "recomputed by the actor (the gap is logged: engine_logprob_gap_mean/max).",
                        choices=("hf", "vllm"), name="generation_backend")
    gpu_memory_utilization: float = flag(0.3, "vllm: the share of the GPU's memory the engine may take (its weights "
                                         "and KV cache), beside the training models (vLLM's CPU build: of the "
                                         "machine's memory).",
                                         name="vllm_gpu_memory_utilization")
    kv_cache_gb: float = flag(0.0, "vllm: the engine's KV cache in GiB (0: what --vllm_gpu_memory_utilization "
                              "leaves after the weights).", name="vllm_kv_cache_gb")
    enable_sleep_mode: bool = flag(False, "vllm, GPU only: the engine frees its weights and KV cache while the models "
                                   "train and takes them back before generating.", name="vllm_enable_sleep_mode")
    tensor_parallel_size: int = flag(1, "vllm: devices one engine spans.  In a training run, groups of this many "
                                     "consecutive ranks share an engine: each group's prompts are generated "
                                     "together and every rank keeps its own answers (the world size must be a "
                                     "multiple); in a tool, the engine starts that many workers.",
                                     name="vllm_tensor_parallel_size")

    def argv(self) -> list[str]:
        """These settings as command-line flags (those that differ from the defaults), to hand them on to
        another entry point (the quick start's ``marlhf generate`` and step 3)."""
        out = []
        for field in dataclasses.fields(self):
            value, spec = getattr(self, field.name), field.metadata["flag"]
            name = "--" + (spec["name"] or field.name)
            if value != spec["default"]:
                out += [name] if isinstance(value, bool) else [name, str(value)]
        return out

    def check(self, *, on_gpu: bool, world_size: int | None = None) -> None:
        """The engine's options, checked with the flags (ValueError naming the flag) before any model loads;
        ``world_size``: the run's ranks, which a tensor-parallel group must divide (default: the launcher's
        WORLD_SIZE, 1 outside a launched run)."""
        world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        default = type(self)()
        flags = {"--vllm_gpu_memory_utilization": self.gpu_memory_utilization != default.gpu_memory_utilization,
                 "--vllm_kv_cache_gb": self.kv_cache_gb != default.kv_cache_gb,
                 "--vllm_enable_sleep_mode": self.enable_sleep_mode,
                 "--vllm_tensor_parallel_size": self.tensor_parallel_size != default.tensor_parallel_size}
        if self.backend != "vllm":
            given = [name for name, changed in flags.items() if changed]
            if given:
                raise ValueError(f"{', '.join(given)}: for --generation_backend vllm, not {self.backend}")
            return
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--vllm_tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if world_size > 1 and world_size % self.tensor_parallel_size:
            raise ValueError(f"--vllm_tensor_parallel_size {self.tensor_parallel_size} must divide the run's "
                             f"{world_size} ranks (each group of that many consecutive ranks shares an engine)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--vllm_gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_gb < 0:
            raise ValueError(f"--vllm_kv_cache_gb must be >= 0 (0: the engine's default), got {self.kv_cache_gb}")
        if self.enable_sleep_mode and not on_gpu:
            raise ValueError("--vllm_enable_sleep_mode frees GPU memory; there is no GPU here: drop it")


# ---------------------------------------------------------------------------------------------------------
# steps 1-2
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class SupervisedSection(Section):
    """Steps 1-2 (and DPO): the model, its batches and lengths (the engine's optimizer is its
    :class:`EngineSection`)."""

    TITLE = "model and batches"

    model_name_or_path: str = flag("", "Hugging Face model name or local folder (default: the embedded tiny "
                                   "model, built on first use).")
    micro_batch: int = flag(8, "Micro-batch size per rank for training.", name="per_device_train_batch_size")
    eval_micro_batch: int = flag(8, "Micro-batch size per rank for evaluation.", name="per_device_eval_batch_size")
    max_seq_len: int = flag(512, "Prompt + response tokens; longer responses are truncated; a prompt that leaves no "
                            "room for the response is handled by --long_prompts (truncated to half the length).")
    learning_rate: float | None = flag(None, "Peak learning rate (default: for the embedded tiny model 1e-3 in "
                                       "SFT, 5e-4 for a reward model, 1e-4 in DPO; otherwise the paper's value for "
                                       "the model's size class: Table 5, and C.3's 2e-7 for DPO).")
    weight_decay: float = flag(0.0, "AdamW weight decay.")
    gradient_checkpointing: bool = flag(False, "Recompute activations in backward to save memory.")
    dropout: float | None = flag(None, "Override the model's dropout probabilities (None keeps the config's).")
    group_by_length: bool = flag(False, "Batch training examples of similar length (sorted within mega-batches of "
                                 "50 batches, the batches shuffled): less padding, the same examples per epoch.")
    schedule: ScheduleSection
    robustness: RobustnessSection


@dataclass(frozen=True, kw_only=True)
class SFTSection(Section):
    """Step 1's loss."""

    TITLE = "SFT loss"

    prompt_loss: bool = flag(False, "Train (and evaluate the held-out loss) on the prompt's tokens too, as "
                             "DeepSpeed-Chat's step 1 does; off: the loss covers the answer only.")


@dataclass(frozen=True, kw_only=True)
class RewardModelSection(Section):
    """Step 2's reward model and its pairwise loss (:mod:`marlhf.models.reward`, :mod:`marlhf.cli.rm`)."""

    TITLE = "reward model"

    label_smoothing: float = flag(0.0, "ε of the pairwise loss −(1−ε) log σ(Δ) − ε log σ(−Δ): the share of pairs "
                                  "assumed mislabelled (0 = the plain Bradley–Terry loss).")
    reward_loss: str = flag("last", "Pairwise loss on the final-token scores ('last', the score step 3 uses) or on "
                            "the per-token rewards over the span where chosen and rejected differ ('divergence', "
                            "DeepSpeed-Chat's); accuracy is on the scores either way.", choices=("last", "divergence"))
    likelihood_term: bool = flag(False, "Add α·Σ log p(answer | prompt) to the score, under a next-token head over "
                                 "the reward model's hidden states started from the SFT model's (α learnt, from 1): "
                                 "the head sees whether each answer token was to be expected, which a score head "
                                 "on the last token learns poorly (a replaced fact).  Costs one vocabulary-wide "
                                 "projection per answer token when scoring.")
    likelihood_norm: str = flag("sum", "The likelihood term over the answer: 'sum' α·Σ log p (longer answers score "
                                "lower by their length alone), 'mean' α·mean log p (no length bias). A folder's "
                                "term keeps the norm it was trained with.", choices=("sum", "mean"))
    likelihood_scale: float = flag(1.0, "α at the start of a fresh likelihood term (then learnt). With 'mean', the "
                                   "typical answer length gives the term the summed one's weight at that length, "
                                   "without its slope in length.")


@dataclass(frozen=True, kw_only=True)
class DPOSection(Section):
    """Step 2's alternative: DPO / IPO of the SFT policy (paper App. C.3)."""

    TITLE = "DPO loss"

    ref_model_name_or_path: str = flag("", "The frozen reference model (default: --model_name_or_path, the SFT "
                                       "model the policy starts from).")
    beta: float = flag(0.1, "β of DPO/IPO: how far the policy may move from the reference (paper C.3: 0.1 on "
                       "TL;DR, 0.01 on HH-RLHF).")
    dpo_loss: str = flag("sigmoid", "sigmoid: DPO's -log σ(β h); ipo: IPO's (h - 1/(2β))², h the chosen-minus-"
                         "rejected log-ratio margin.", choices=("sigmoid", "ipo"))


@dataclass(frozen=True, kw_only=True)
class HeldOutReferenceSection(Section):
    """``marlhf eval-policy``'s reference policy (the held-out KL's)."""

    TITLE = "reference model"

    ref_model_name_or_path: str = flag("", "Reference policy of the held-out KL (e.g. the SFT model); empty: no KL.")
