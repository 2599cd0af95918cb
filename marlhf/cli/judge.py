"""Pairwise win rate of policy A vs policy B, judged by a model behind an OpenAI-compatible endpoint
(the paper's GPT-4 evaluation, §4.1 and App. F.1).

    export OPENAI_API_KEY=...            # read from the environment (or --api_key_file), never logged
    marlhf judge --task dialogue --a sft.jsonl --b ppo.jsonl \\
        --base_url https://api.openai.com/v1 --model gpt-4o --output judged.jsonl

``--a`` / ``--b``: jsonl rows {"prompt": ..., "response": ...}, row k of both files for the same prompt.
The task folder (``marlhf/applications/<task>/``) gives the judge prompt and post-processes the responses.  Each
pair is shown in a random order fixed by ``--seed`` (recorded per pair in ``--output`` and undone);
answers are cached under ``--cache_dir`` so a rerun sends no request twice.  Prints the summary (wins,
ties, losses of A with 95% intervals, unparseable answers, failed requests) as JSON.

A local judge goes through the same comparison (order randomised, recorded, undone) without any endpoint:
``--judge reward_model --reward_model out/step2`` (the higher reward-model score wins) or ``--judge gold``
(the embedded task's gold scorer; it sees the answer text only, not whether generation ended):

    marlhf judge --task summarization --a ppo.jsonl --b sft.jsonl --judge gold
"""

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from marlhf.data.adapters.files import iter_file_rows
from marlhf.data.records import DataError, require_text
from marlhf.embedded.task import gold_scores
from marlhf.errors import ConfigError, run_cli
from marlhf.eval.judge import ChatCompletionsJudge, ScorerJudge, compare_policies, summarize
from marlhf.sections import ScheduleSection
from marlhf.tasks import load_task
from marlhf.utils.flags import add_flags


def read_responses(path: str) -> list[tuple[str, int, str, str]]:
    """(file, row, prompt, response) of each row; a bad row is a DataError naming file, row and field."""

    if not Path(path).is_file():
        raise ConfigError(f"responses file {path!r} does not exist")
    out = []
    for file, n, row in iter_file_rows(Path(path)):
        if isinstance(row, DataError):
            raise row
        prompt = require_text(row, "prompt", file, n)
        response = row.get("response")
        if not isinstance(response, str):  # an empty answer is a legitimate (losing) response
            raise DataError(file, n, "response", "missing" if response is None
                            else f"expected text, got {type(response).__name__}")
        out.append((file, n, prompt, response))
    return out


def read_pairs(path_a: str, path_b: str) -> list[tuple[str, str, str]]:
    """(prompt, response of A, response of B): row k of both files answers the same prompt."""
    a, b = read_responses(path_a), read_responses(path_b)
    if len(a) != len(b):
        raise ConfigError(f"{path_a} has {len(a)} rows but {path_b} has {len(b)}: they must answer the same prompts")
    for (file_a, row_a, prompt_a, _), (file_b, row_b, prompt_b, _) in zip(a, b):
        if prompt_a != prompt_b:
            raise DataError(file_b, row_b, "prompt", f"differs from the prompt of {file_a} row {row_a}")
    return [(p, ra, rb) for (_, _, p, ra), (_, _, _, rb) in zip(a, b)]


def local_judge(kind: str, reward_model: str, tie_margin: float, batch_size: int, device: str = "auto",
                dtype: str = "auto", attn_implementation: str = "auto"):
    """A reward model or the embedded task's gold scorer as the judge (the higher score wins); the reward model on
    ``device`` in ``dtype`` (:mod:`marlhf.models.placement`) with ``attn_implementation``."""

    if kind == "reward_model":
        if not reward_model:
            raise ConfigError("--judge reward_model needs --reward_model (a step-2 output folder)")
        from marlhf.models.loading import attention_implementation
        from marlhf.rewards.reward_model import Scorer

        with attention_implementation(attn_implementation):
            rm = Scorer(reward_model, device=device, dtype=dtype)
        return ScorerJudge(lambda p, r: rm(p, r, batch_size), tie_margin)

    return ScorerJudge(gold_scores, tie_margin)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True,
                        help="The task (marlhf/tasks.py): a name (summarization, dialogue, ...), "
                        "alias (tldr, hh, ...) or folder")
    parser.add_argument("--a", required=True, help="jsonl of policy A's responses")
    parser.add_argument("--b", required=True, help="jsonl of policy B's responses")
    parser.add_argument("--judge", default="api", choices=("api", "reward_model", "gold"),
                        help="api: a model behind --base_url; reward_model / gold: a local scorer, higher wins")
    parser.add_argument("--reward_model", default="", help="--judge reward_model: the step-2 output folder")
    parser.add_argument("--tie_margin", type=float, default=0.0, help="Local judges: |score difference| <= this ties")
    parser.add_argument("--batch_size", type=int, default=16, help="Local reward-model judge's batch")
    parser.add_argument("--device", default="auto", help="Local reward-model judge: auto (the GPU when there is "
                        "one, else the CPU), cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
                        help="Local reward-model judge: auto is bf16 on a GPU that supports it, else fp32")
    parser.add_argument("--attn_implementation", default="auto",
                        choices=("auto", "sdpa", "flash_attention_2", "eager"),
                        help="Local reward-model judge's attention (auto: per architecture, as the training steps)")
    parser.add_argument("--base_url", default=os.environ.get("OPENAI_BASE_URL"),
                        help="chat-completions endpoint base, e.g. https://api.openai.com/v1 (env OPENAI_BASE_URL)")
    parser.add_argument("--model", default=os.environ.get("MARLHF_JUDGE_MODEL"), help="(env MARLHF_JUDGE_MODEL)")
    parser.add_argument("--api_key_env", default="OPENAI_API_KEY", help="environment variable holding the key")
    parser.add_argument("--api_key_file", default=None, help="file holding the key (instead of the environment)")
    add_flags(parser, ScheduleSection, only=("seed",), help={"seed": "fixes the order each pair is shown in"})
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at most")
    parser.add_argument("--max_retries", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    parser.add_argument("--max_tokens", type=int, default=256)
    parser.add_argument("--cache_dir", default=os.path.join(os.environ.get("MARLHF_HOME", "~/.cache/marlhf"),
                                                            "judge_cache"))
    parser.add_argument("--output", default=None, help="jsonl: one row per pair (order shown, answer, outcome)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    app = load_task(args.task)
    pairs = read_pairs(args.a, args.b)
    if args.judge == "api":
        if not args.base_url or not args.model:
            parser.error("--base_url and --model are required (or OPENAI_BASE_URL / MARLHF_JUDGE_MODEL)")
        if args.api_key_file:
            key = Path(args.api_key_file).read_text().strip()
        else:
            key = os.environ.get(args.api_key_env) or None
        judge = ChatCompletionsJudge(args.base_url, args.model, app.judge_template, api_key=key,
                                     verdict_format=app.verdict_format, cache_dir=os.path.expanduser(args.cache_dir),
                                     concurrency=args.concurrency, max_retries=args.max_retries,
                                     timeout_s=args.timeout, max_tokens=args.max_tokens)
        logging.info("judging %d pairs with %r (task %s, key %s)", len(pairs), judge, app.name,
                     "set" if key else "not set")
    else:
        judge = local_judge(args.judge, args.reward_model, args.tie_margin, args.batch_size, args.device, args.dtype,
                            args.attn_implementation)
        logging.info("judging %d pairs with the local %s judge (task %s)", len(pairs), args.judge, app.name)
    outcomes = compare_policies(judge, [p for p, _, _ in pairs], [app.postprocess(a) for _, a, _ in pairs],
                                [app.postprocess(b) for _, _, b in pairs], seed=args.seed)
    summary = summarize(outcomes)
    summary["judge"] = args.judge
    if args.judge == "api":
        summary["requests_sent"] = judge.requests_sent
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            for o in outcomes:
                f.write(json.dumps(o.to_dict()) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
