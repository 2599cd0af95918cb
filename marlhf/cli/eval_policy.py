"""Held-out evaluation of a trained policy exactly as step 3 evaluates its actor: the same held-out prompts,
sampling settings, seed and scores (reward model, gold scorer on the embedded task, program tests), and the
KL to a reference policy.  What makes a DPO model, an SFT model and a step-3 actor comparable number for
number (``scripts/reproduce.py`` uses it for DPO; a step-3 run's ``summary.json`` holds the same fields).

    marlhf eval-policy --actor_model_name_or_path out/dpo --ref_model_name_or_path out/step1 \\
        --reward_model_name_or_path out/step2 --data_path synthetic --data_seed 1234 --max_eval_samples 64 \\
        --output_dir out/dpo-eval

Takes step 3's flags (the data selection, generation and batch flags must match the runs it is compared
with); a step-3 output folder evaluates its ``actor/``.  Writes ``<output_dir>/eval.json`` and prints it.
"""

import json
import sys
from pathlib import Path

from marlhf.cli._memory import check_memory, plan_only
from marlhf.cli._run import data_section, entry_point, reward_source, start
from marlhf.config import PolicyEvalArgs, parse_args
from marlhf.data.formatting import check_same_format
from marlhf.data.pipeline import build_phase_data, held_out_part
from marlhf.errors import run_cli
from marlhf.eval.generate_tool import policy_folder
from marlhf.eval.policy import evaluate_policy
from marlhf.models.loading import load_causal_lm, load_options, load_reward_model, resolve_model_path, stop_token_ids
from marlhf.rewards import OWN_EVALUATION_NAMES, evaluation_sources
from marlhf.rlhf.sections import EvalSection
from marlhf.sections import GenerationEngineSection, SamplingSection
from marlhf.utils import dist
from marlhf.utils.ds_engine import frozen_engine


@entry_point
def main(argv=None):
    args, _ = parse_args(PolicyEvalArgs, argv)
    if args.plan_only:  # the memory plan from the models' configs alone (a folder with only config.json too)
        given = args.actor_model_name_or_path
        bare = bool(given) and (Path(given) / "config.json").is_file() and not (Path(given) / "actor").is_dir()
        return plan_only("eval", args, given if bare else policy_folder(given, "actor"))
    # 1. the policy (a step-3 output folder: its actor/), its tokenizer and format, and step 3's held-out prompts
    run = start(args, "actor_model_name_or_path", padding_side="left",
                model=policy_folder(args.actor_model_name_or_path, "actor"))
    tokenizer, fmt = run.tokenizer, run.fmt
    check_memory("eval", args, run.model)  # before any weight loads: refuses a plan the GPU cannot hold
    rm_path = args.reward_model_name_or_path or args.critic_model_name_or_path
    check_same_format(fmt, rm_path, args.ref_model_name_or_path, *args.reward_ensemble)
    data = build_phase_data(data_section(args, fmt), tokenizer, phase=3)

    # 2. the policy, the reference (for the KL) and the reward model, all frozen, loaded as step 3 loads them: in
    #    the run's --dtype, built partitioned under ZeRO-3, with --attn_implementation; the engines put them on
    #    the accelerator
    def frozen(model):
        return frozen_engine(model, zero_stage=args.actor_zero_stage, offload=args.offload_reference_model,
                             dtype=args.dtype)

    load = load_options(args.dtype, args.actor_zero_stage, args.offload_reference_model, args.attn_implementation)
    actor = frozen(load_causal_lm(resolve_model_path(run.model), tokenizer, 0.0,
                                  end_of_conversation_token=fmt.end_of_conversation_token, **load))
    ref = frozen(load_causal_lm(resolve_model_path(args.ref_model_name_or_path), tokenizer, 0.0, **load)) \
        if args.ref_model_name_or_path else None
    reward_model = frozen(load_reward_model(resolve_model_path(rm_path), tokenizer, 0.0, **load)) if rm_path else None
    ensemble = [frozen(load_reward_model(resolve_model_path(p), tokenizer, 0.0, **load)) for p in args.reward_ensemble]
    # 3. the sources step 3 reports: the reward model's score, the gold score, the program tests / user's reward,
    #    an ensemble's reward
    reward = reward_source(args, run.task, reward_model, ensemble) \
        if args.reward_source in OWN_EVALUATION_NAMES or ensemble else None  # rm and gold: whenever available
    sources = evaluation_sources(args.reward_source, reward, reward_model, run.task)
    generation = SamplingSection.build(args).generation(stop_token_ids(tokenizer, fmt.end_of_conversation_token),
                                                        tokenizer.pad_token_id)
    held_out = held_out_part(data.eval, args.eval_prompts)
    engine = None
    if args.generation_backend == "vllm":  # the policy's folder in a vLLM engine: it samples, the actor scores
        from marlhf.vllm_sampler import VLLMSampler

        engine = VLLMSampler(resolve_model_path(run.model), GenerationEngineSection.build(args),
                             max_model_len=args.max_prompt_seq_len + args.max_answer_seq_len, dtype=args.dtype,
                             seed=args.seed)
    result = evaluate_policy(actor, tokenizer, held_out, EvalSection.build(args), generation, sources, ref=ref,
                             engine=engine)
    result["policy"] = run.model
    if dist.is_main():
        (Path(args.output_dir) / "eval.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
