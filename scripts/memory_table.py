"""docs/gpu.md's memory table: every launch script's step planned at its own flags (marlhf/cli/_memory.py).

Each script under training/step*/training_scripts/{gemma,gemma2,llama3.2,codegemma} runs with a fake ``deepspeed``
first on PATH that records its command line (no training); the step's own parser reads the flags; the model
paths are replaced by the public config.json of the script's architecture (tests/fixtures/model_configs, no
weights); the plan is per GPU over the script's ``--num_gpus`` (8) and checked against an 80 GiB GPU.  The README's
own-model commands (bf16, ZeRO-2, the flags' defaults otherwise) are planned for the models its comment names.

    python scripts/memory_table.py            # rewrite the table between the markers in docs/gpu.md
    python scripts/memory_table.py --check    # exit 1 when docs/gpu.md's table is not what this writes
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "model_configs"
DOC = ROOT / "docs" / "gpu.md"
START, END = "<!-- memory-table:start (scripts/memory_table.py) -->", "<!-- memory-table:end -->"
GPU_GIB = 80
# the script's family/size -> the architecture's config (CodeGemma is Gemma's architecture)
FAMILIES = {("gemma", "2b"): "gemma-2b", ("gemma", "7b"): "gemma-7b", ("gemma2", "27b"): "gemma2-27b",
            ("llama3.2", "3b"): "llama3.2-3b", ("codegemma", "2b"): "gemma-2b", ("codegemma", "7b"): "gemma-7b"}
STEPS = {"step1_supervised_finetuning": "sft", "step2_reward_model_finetuning": "rm",
         "step2_dpo_finetuning": "dpo", "step3_rlhf_finetuning": "ppo"}
MODEL_FLAGS = ("model_name_or_path", "ref_model_name_or_path", "actor_model_name_or_path",
               "critic_model_name_or_path", "reward_model_name_or_path")
# the README's "Run it on your own model" block: its flags beside the defaults, the models its comment names
README_FLAGS = {"sft": ["--dtype", "bf16", "--zero_stage", "2"], "rm": ["--dtype", "bf16", "--zero_stage", "2"],
                "ppo": ["--dtype", "bf16", "--actor_zero_stage", "2", "--critic_zero_stage", "2"]}
README_MODELS = ("gemma-2b", "llama3.2-3b", "gemma-7b", "llama3-8b")
# what the README's "Large models" line adds for 7B and up (step 3's four models at ZeRO-2 need ~100 GiB per GPU)
README_LARGE = ("gemma-7b", "llama3-8b")
LARGE_FLAGS = ["--actor_zero_stage", "3", "--critic_zero_stage", "3"]

FAKE_DEEPSPEED = """#!/usr/bin/env bash
printf '%s\\0' "$@" > "$FAKE_DS_ARGS"
"""


def launched(script: Path) -> list[str]:
    """The command line ``script`` hands to deepspeed (its defaults: 8 GPUs, the default task)."""
    with tempfile.TemporaryDirectory() as tmp:
        # the scripts run the deepspeed beside `python`: a python that is this one, beside the fake launcher, and
        # passes the scripts' check that the hub models can be had (marlhf.preflight: this plans from configs)
        python = (f'#!/usr/bin/env bash\nif [[ "$1" == -m && "$2" == marlhf.preflight ]]; then exit 0; fi\n'
                  f'exec {sys.executable} "$@"\n')
        for name, text in (("deepspeed", FAKE_DEEPSPEED), ("python", python)):
            (Path(tmp) / name).write_text(text)
            (Path(tmp) / name).chmod(0o755)
        record = Path(tmp) / "argv"
        env = {"PATH": f"{tmp}{os.pathsep}{os.environ['PATH']}", "HOME": tmp, "FAKE_DS_ARGS": str(record),
               "LAUNCHER": "deepspeed", "NUM_GPUS": "8"}  # 8 GPUs: set, as a GPU-less machine requires
        subprocess.run(["bash", str(script)], cwd=tmp, env=env, check=True, capture_output=True, text=True)
        return record.read_bytes().decode().split("\0")[:-1]


def step_args(step: str, flags: list[str]):
    from marlhf.config import DPOArgs, RewardArgs, RLHFArgs, SFTArgs, parse_args

    cls = {"sft": SFTArgs, "rm": RewardArgs, "dpo": DPOArgs, "ppo": RLHFArgs}[step]
    args, _ = parse_args(cls, flags)
    return args


def plan_row(step: str, args, config: str, world: int):
    """(flags in short, plan) of ``args`` with every model path replaced by ``config``'s folder."""
    from transformers import AutoConfig

    from marlhf.cli import _memory as step_plan
    from marlhf.models import memory_plan as mp

    folder = str(CONFIGS / config)
    # the model each step starts from, and step 3's critic (the README's $OUT/rm), are the architecture's
    given = ("actor_model_name_or_path", "critic_model_name_or_path") if step == "ppo" else ("model_name_or_path",)
    args = dataclasses.replace(args, **{f: folder for f in MODEL_FLAGS if getattr(args, f, "") or f in given})
    shapes = step_plan.step_shapes(step, args, folder)
    attn = mp._attn_of(AutoConfig.from_pretrained(folder), args.attn_implementation, args.dtype, step == "rm")
    plan = step_plan.plan_step(step, args, shapes, world, attn)
    return describe(step, args, attn), plan


def describe(step: str, args, attn: str) -> str:
    if step == "ppo":
        zero = f"ZeRO {args.actor_zero_stage}/{args.critic_zero_stage}"
        ckpt = args.actor_gradient_checkpointing
        batch = (f"gen {args.per_device_generation_batch_size}x{args.num_samples_per_prompt}, train "
                 f"{args.per_device_training_batch_size} x {args.max_prompt_seq_len + args.max_answer_seq_len}")
        offload = " offload" + (" +ref" if args.offload_reference_model else "") if args.offload else ""
    else:
        zero, ckpt = f"ZeRO {args.zero_stage}", args.gradient_checkpointing
        batch = f"{args.per_device_train_batch_size} x {args.max_seq_len}"
        offload = " offload" if args.offload else ""
    return f"{args.dtype} {zero}{offload}{' ckpt' if ckpt else ''}, {attn}, {batch}"


def table() -> str:
    from marlhf.models import memory_plan as mp

    device = GPU_GIB * mp.GiB
    lines = ["| launch script | step | model | flags (per-device batch x tokens) | model states | largest transient "
             "| peak per GPU | fits 8 x 80 GiB |", "|---|---|---|---|---|---|---|---|"]

    def row(where, step, config, args, world):
        flags, plan = plan_row(step, args, config, world)
        name = max(plan.transient, key=plan.transient.get)
        verdict = "yes" if mp.fits(plan, device) else "**no**"
        lines.append(f"| {where} | {step} | {config} | {flags} | {mp.gib(plan.model_state_bytes)} | {name}: "
                     f"{mp.gib(plan.transient[name])} | {mp.gib(plan.peak)} | {verdict} |")

    for step_dir, step in STEPS.items():
        for (family, size), config in FAMILIES.items():
            script = ROOT / "training" / step_dir / "training_scripts" / family / f"run_{size}.sh"
            if not script.is_file():
                continue
            argv = launched(script)
            main = next(i for i, a in enumerate(argv) if a.endswith("/main.py"))
            world = int(argv[argv.index("--num_gpus") + 1]) if "--num_gpus" in argv else 8
            row(f"`{script.relative_to(ROOT / 'training')}`", step, config, step_args(step, argv[main + 1:]), world)
    for config in README_MODELS:
        for step, flags in README_FLAGS.items():
            row("README own-model block", step, config, step_args(step, flags), 8)
    for config in README_LARGE:
        row("README, + `--actor_zero_stage 3 --critic_zero_stage 3`", "ppo", config,
            step_args("ppo", README_FLAGS["ppo"] + LARGE_FLAGS), 8)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 when docs/gpu.md's table differs")
    args = p.parse_args(argv)
    text = DOC.read_text()
    head, rest = text.split(START)
    _, tail = rest.split(END)
    new = f"{head}{START}\n{table()}\n{END}{tail}"
    if args.check:
        if new != text:
            print("docs/gpu.md's memory table is stale: python scripts/memory_table.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
