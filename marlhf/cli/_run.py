"""What every training entry point does first, once: start the run from its flags and resolve what the flags leave
open — the model an empty path stands for (the embedded default), the task, the end token and prompt format in
force — into a run context recorded in ``args.json`` (:mod:`marlhf.utils.run`), never written back into the flags.
Past this point the library receives sections and explicit values, not the flags.

The library is imported inside the functions, not here: an entry point imports this module at its top, and
``marlhf ppo --help`` should answer without importing torch (tests/test_cli.py)."""

from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from marlhf.tasks import resolve_task, response_kind

if TYPE_CHECKING:
    from marlhf.data.formatting import ConversationFormat
    from marlhf.tasks import Task


@dataclass(frozen=True)
class Started:
    """A started run: its model folder, tokenizer, conversation format and task (None: no task)."""

    model: str
    tokenizer: object
    fmt: ConversationFormat
    task: Task | None


def entry_point(main):
    """A training entry point's ``main(argv)``: the log file :func:`start` opened is closed when it returns or
    raises, so a run called in-process (a notebook, a test) leaves no handler on its folder behind."""

    @functools.wraps(main)
    def run(argv=None):
        try:
            return main(argv)
        finally:
            tracking = sys.modules.get("marlhf.utils.tracking")  # not imported (--help, a bad flag): no log opened
            if tracking is not None:
                tracking.close_run_log()

    return run


def start(args, model_flag: str, padding_side: str = "right", model: str | None = None) -> Started:
    """Set up the run (process group, seed, logs, args.json), then resolve and record its context: ``model_flag``
    names the flag holding the model the step starts from (its tokenizer and format are the run's); ``model``:
    the folder it resolves to when the tool resolved it already (default: the flag, the embedded model if empty)."""
    from marlhf.embedded import default_model
    from marlhf.models.loading import load_tokenizer_and_format
    from marlhf.preflight import check_data, check_model
    from marlhf.utils.run import record_run_context, setup_run

    setup_run(args.output_dir, seed=args.seed, dtype=args.dtype, flags=dataclasses.asdict(args),
              save_steps=args.save_steps, resume=args.resume)
    model = model or default_model(getattr(args, model_flag))
    # a model or dataset the hub cannot give stops the run here, as one message from rank 0 (errors.run_cli),
    # not as a connection traceback from every rank
    check_model(model, f"--{model_flag}")
    check_data(args.data_path)
    tokenizer, fmt = load_tokenizer_and_format(model, args.end_of_conversation_token, args.prompt_format,
                                               padding_side=padding_side, add_eot_token=args.add_eot_token)
    task = resolve_task(args.task, args.data_path)
    record_run_context(args.output_dir, task=task.name if task else None, **{model_flag: model},
                       end_of_conversation_token=fmt.end_of_conversation_token, prompt_format=fmt.prompt_format)
    return Started(model, tokenizer, fmt, task)


def data_section(args, fmt: ConversationFormat):
    """The step's :class:`~marlhf.sections.DataSection` in the conversation format the run resolved (its end
    token and prompt format, not the flags' 'auto' / empty values)."""
    from marlhf.sections import DataSection

    return DataSection.build(args, end_of_conversation_token=fmt.end_of_conversation_token,
                             prompt_format=fmt.prompt_format)


def reward_source(args, task: Task | None, reward_model=None, ensemble=()):
    """Step 3's ``--reward_source`` (and its flags) built (:func:`marlhf.rewards.build_reward_source`);
    ``ensemble``: --reward_ensemble's other reward models, loaded."""
    from marlhf.rewards import build_reward_source

    return build_reward_source(args.reward_source, reward_model=reward_model, task=task, workers=args.reward_workers,
                               function=args.reward_function, url=args.reward_url, timeout=args.reward_timeout,
                               retries=args.reward_retries, ensemble=ensemble,
                               ensemble_reduce=args.reward_ensemble_reduce,
                               ensemble_std_coef=args.reward_ensemble_std_coef)


def step3_context(args, started_actor: str, task: Task | None) -> dict:
    """What step 3 resolves beside the actor: the critic / reward model paths (an empty critic flag with a reward
    model is the embedded default) and the response kind (the task's, else from the reward source)."""
    from marlhf.embedded import default_model
    from marlhf.rlhf.rlhf_engine import model_paths

    paths = model_paths(started_actor, args.critic_model_name_or_path, args.reward_model_name_or_path,
                        args.reward_source, default=lambda: default_model(""))
    paths.pop("actor_model_name_or_path")
    return {**paths, "response_kind": response_kind(args.response_kind, task, args.reward_source)}


def mappo_sections(args, *, response_kind: str, stop_ids, pad_id: int):
    """Step 3's sections from its flags, with the run's resolved response kind and the tokenizer's stop and pad ids:
    one policy section and one batch section, shared by the rollout and the update; the rollout told what the
    termination rule reads (so it runs only the forwards something reads)."""
    from marlhf.rlhf.sections import (
        BatchSection,
        MacroSection,
        PolicySection,
        ReportSection,
        RolloutSection,
        UpdateSection,
    )
    from marlhf.rlhf.termination import rule_inputs
    from marlhf.rlhf.trainer import MAPPOSections
    from marlhf.sections import LoopSection, RobustnessSection, SamplingSection

    macro, policy, batches = (MacroSection.build(args, response_kind=response_kind), PolicySection.build(args),
                              BatchSection.build(args))
    # a generation engine's answers: the actor recomputes log π_old itself (what the engine's numbers and the
    # truncated importance weights are compared with), as if the rule read it
    reads = rule_inputs(macro) | ({"logprobs"} if args.generation_backend == "vllm" else set())
    return MAPPOSections(
        macro=macro, rollout=RolloutSection.build(args, policy=policy, batches=batches, rule_inputs=frozenset(reads)),
        update=UpdateSection.build(args, policy=policy, batches=batches), batches=batches, loop=LoopSection.build(args),
        generation=SamplingSection.build(args).generation(stop_ids, pad_id), robustness=RobustnessSection.build(args),
        ema_decay=args.ema_decay, report=ReportSection.build(args))


def step3_trainer(args, actor: str, tokenizer, fmt: ConversationFormat, context: dict, task: Task | None,
                  total_steps: int, reward=None):
    """Step 3 from its flags and its run context (:func:`step3_context`): the four models' engines
    (:func:`marlhf.rlhf.rlhf_engine.build_rlhf_engine`) and the MA-PPO recipe with its reward source (``reward``:
    one built already, else ``--reward_source``'s).  Returns ``(trainer, learning rates in force)``."""
    from marlhf.models.loading import stop_token_ids
    from marlhf.rlhf.advantages import estimator_class
    from marlhf.rlhf.rlhf_engine import build_rlhf_engine
    from marlhf.rlhf.sections import ModelsSection
    from marlhf.rlhf.trainer import MAPPOTrainer

    sections = mappo_sections(args, response_kind=context["response_kind"],
                              stop_ids=stop_token_ids(tokenizer, fmt.end_of_conversation_token),
                              pad_id=tokenizer.pad_token_id)
    models = ModelsSection.build(args, actor_path=actor, critic_path=context["critic_model_name_or_path"],
                                 reward_path=context["reward_model_name_or_path"],
                                 needs_critic=estimator_class(args.advantage_estimator).needs_critic,
                                 end_of_conversation_token=fmt.end_of_conversation_token)
    rlhf = build_rlhf_engine(models, args.engine("actor"), args.engine("critic"), sections.batches, tokenizer,
                             total_steps)
    reward = reward if reward is not None else reward_source(args, task, rlhf.reward, rlhf.reward_ensemble)
    engine = None
    if args.generation_backend == "vllm":  # after the models: the engine takes what memory they leave
        from marlhf.sections import GenerationEngineSection
        from marlhf.vllm_sampler import VLLMSampler

        engine = VLLMSampler(actor, GenerationEngineSection.build(args),
                             max_model_len=args.max_prompt_seq_len + args.max_answer_seq_len, dtype=args.dtype,
                             seed=args.seed)
    return MAPPOTrainer(rlhf, tokenizer, sections, reward=reward, engine=engine), rlhf.learning_rates
