"""The ``marlhf`` command: one subcommand per entry point, each a module with ``main(argv)``.

    marlhf sft | rm | dpo | ppo ...          the three steps and DPO (DeepSpeed-Chat's flags)
    deepspeed --num_gpus 8 --module marlhf.cli.ppo ...   the same, one process per GPU (or a hostfile)

``training/step*/main.py`` (DeepSpeed-Chat's layout, run by the launch scripts) import these modules.
"""

# subcommand -> (module under marlhf.cli, one line for `marlhf --help`)
COMMANDS = {
    "sft": ("sft", "step 1: supervised fine-tuning of a causal LM on prompt + chosen answer"),
    "rm": ("rm", "step 2: reward model (LM + scalar head) on preference pairs"),
    "label": ("label", "preference pairs on a policy's own answers, labelled by a simulated annotator"),
    "dpo": ("dpo", "step 2 alternative: DPO / IPO of the SFT policy on preference pairs"),
    "ppo": ("ppo", "step 3: RLHF with MA-PPO (PPO over macro actions; --ngram 1 is vanilla PPO), GRPO, RLOO"),
    "quickstart": ("quickstart", "the main job: steps 1 -> 2 -> 3 as the launch scripts run them, then a summary"),
    "generate": ("generate", "sample a policy's answers to prompts into a resumable JSON-lines file"),
    "score-pairs": ("score_pairs", "a reward model's score of each prompt/response pair; accuracy on chosen/rejected"),
    "score-policies": ("score_policies", "several policies' generations scored by a reward model (and the gold "
                       "scorer): distributions, shifts against a baseline"),
    "eval-policy": ("eval_policy", "held-out evaluation of any policy exactly as step 3 evaluates its actor"),
    "judge": ("judge", "pairwise win rate of two policies by an LLM judge, a reward model or the gold scorer"),
    "best-of-n": ("best_of_n", "best-of-N sampling scored by a reward model, over N and temperature"),
    "pass-at-k": ("pass_at_k", "pass@k of generated programs on APPS problems"),
    "execute": ("execute", "run one program against one APPS problem in the sandbox"),
    "chat": ("chat", "talk to a policy, turn by turn"),
    "export": ("export", "export a step's output (or checkpoint) as a Hugging Face folder with a model card"),
}

# earlier names, still accepted: rw-eval is DeepSpeed-Chat's (training/step2_reward_model_finetuning/rw_eval.py)
RENAMED = {"rw-eval": "score-pairs", "rm-eval": "score-policies"}
