"""Talk to a policy, turn by turn, in its task's dialogue format (HH "Human: … Assistant:" by default).

    marlhf chat --model out/step3
    marlhf chat --model out/step1 --task dialogue --temperature 0.7 --show_prompt

The history of the conversation is part of every prompt.  Commands: ``/reset`` forgets the history,
``/quit`` (or end of input, Ctrl-D) leaves.  ``--show_prompt`` prints the exact text the model reads before
each answer (between ``[prompt]`` and ``[/prompt]`` lines).  The end token and prompt format are the model
folder's recorded ones.
"""

from __future__ import annotations

import argparse
import logging
import sys

from marlhf.errors import run_cli
from marlhf.eval.chat import ChatSession
from marlhf.eval.generate_tool import LoadedPolicy, add_sampling_args
from marlhf.sections import GenerationEngineSection, SamplingSection, ScheduleSection
from marlhf.tasks import load_task
from marlhf.utils.flags import add_flags

USER_PROMPT = "You> "


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sampling_args(p)
    p.add_argument("--task", default="dialogue",
                   help="The task (marlhf/tasks.py: a name, alias or folder): the turn format and "
                   "post-processing")
    p.add_argument("--greedy", action="store_true")
    add_flags(p, ScheduleSection, only=("seed",),
              help={"seed": "Answer k samples under a seed derived from this and k"})
    p.add_argument("--show_prompt", action="store_true", help="Print the model's input before each answer")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
    app = load_task(args.task)
    policy = LoadedPolicy(args.model, args.model_part, args.end_of_conversation_token, args.prompt_format,
                          device=args.device, dtype=args.dtype, engine=GenerationEngineSection.build(args))
    chat = ChatSession(policy, app, SamplingSection.build(args), greedy=args.greedy, seed=args.seed)
    print(f"chatting with {policy.path} (task {app.name}); /reset forgets the history, /quit leaves", flush=True)
    while True:
        try:
            # the prompt goes to stdout: input() writes it to stderr when both ends are a terminal
            print(USER_PROMPT, end="", flush=True)
            line = input()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        text = line.strip()
        if text == "/quit":
            return 0
        if text == "/reset":
            chat.reset()
            print("(history cleared)", flush=True)
            continue
        if not text:
            continue
        if text.startswith("/"):
            print(f"unknown command {text.split()[0]!r}: /reset or /quit", flush=True)
            continue
        if args.show_prompt:
            print(f"[prompt]\n{chat.model_input(text)}\n[/prompt]", flush=True)
        print(f"Assistant> {chat.reply(text)}", flush=True)


if __name__ == "__main__":
    sys.exit(run_cli(main))
