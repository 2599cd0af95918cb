"""How finely the low-probability rule splits a policy's answers, for each threshold τ.

``--termination_condition lowprob --lowprob_threshold τ`` ends a macro action at every token whose probability
under the reference (or the sampling policy) is below τ.  How many actions that makes depends on how confident
the model is: a model that copies facts from its prompt puts most tokens above 0.9, and τ = 0.1 then leaves
about one action per answer — the same as ``--ngram inf``.  This samples answers from ``--policy`` as step 3
does (temperature, top-k, answer length), scores their tokens with ``--reference`` and prints, for each τ, the
actions per answer and the tokens per action, next to what fixed n-grams give the same answers — so τ can be
chosen for a comparison at a given granularity.

    python scripts/lowprob_threshold.py --policy runs/quickstart/step1 --prompts prompts.jsonl

``--prompts``: JSON lines with a ``prompt`` field (default: the embedded task's records, which step 3's prompts
come from).  Writes ``--out`` (JSON) when given.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from marlhf.data.formatting import PromptFormatter
from marlhf.models.loading import load_causal_lm, load_tokenizer_and_format, stop_token_ids
from marlhf.rlhf.macro import fixed_starts, lowprob_starts
from marlhf.rlhf.rollout import policy_logprobs
from marlhf.sampler import GenerationConfig, sample
from marlhf.sections import SamplingSection, ScheduleSection
from marlhf.utils.flags import add_flags

THRESHOLDS = (0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95)
NGRAMS = (1, 5, 10)


def split_table(mask: torch.Tensor, logprobs: torch.Tensor, thresholds=THRESHOLDS, ngrams=NGRAMS) -> list[dict]:
    """Per rule: ``rule``, ``actions_per_answer`` (mean over answers with a token) and ``tokens_per_action``
    (all tokens / all actions), for the low-probability rule at each τ and for fixed n-grams.
    ``mask``: (B, T) bool answer tokens; ``logprobs``: (B, T) their log-probabilities."""
    answers = mask.any(1)
    tokens = int(mask.sum())

    def row(rule: str, starts: torch.Tensor) -> dict:
        actions = (starts & mask).sum(1)[answers].double()
        return {"rule": rule, "actions_per_answer": actions.mean().item(),
                "tokens_per_action": tokens / max(actions.sum().item(), 1.0)}

    rows = [row(f"lowprob τ={t:g}", lowprob_starts(mask, logprobs, t)) for t in thresholds]
    return rows + [row(f"fixed n={n}", fixed_starts(mask, n)) for n in ngrams]


def read_prompts(path: Path, n: int) -> list[str]:
    prompts = []
    with path.open() as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                prompt = json.loads(line)["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise SystemExit(f"{path}, line {i}: no 'prompt' field ({e})") from None
            prompts.append(prompt)
            if len(prompts) == n:
                break
    if not prompts:
        raise SystemExit(f"{path}: no prompts")
    return prompts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", required=True, help="the model that samples the answers (step 3's actor at its start)")
    p.add_argument("--reference", default="", help="the model whose probabilities end actions (default: --policy)")
    p.add_argument("--prompts", default="", help="JSON lines with a 'prompt' field (default: the embedded task's)")
    p.add_argument("--num_prompts", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=32)
    add_flags(p, SamplingSection, only=("temperature", "top_k", "top_p"))  # step 3's sampling
    p.add_argument("--max_answer_seq_len", type=int, default=64, help="answer tokens (shorter than step 3's: a table)")
    p.add_argument("--thresholds", type=float, nargs="+", default=list(THRESHOLDS))
    add_flags(p, ScheduleSection, only=("seed",))
    p.add_argument("--out", default="", help="write the table here as JSON")
    args = p.parse_args(argv)
    if args.prompts:
        prompts_file = Path(args.prompts)
    else:
        from marlhf.embedded import prepare

        prompts_file = prepare().data_file
    prompts = read_prompts(prompts_file, args.num_prompts)
    # the policy's own prompt format and end token (a model trained here records them; a chat model's template)
    tokenizer, fmt = load_tokenizer_and_format(args.policy, padding_side="left")
    formatter = PromptFormatter(tokenizer, fmt.prompt_format, fmt.end_of_conversation_token)
    policy = load_causal_lm(args.policy, tokenizer, 0.0).eval()
    reference = load_causal_lm(args.reference, tokenizer, 0.0).eval() if args.reference else policy
    stop_ids = tuple(stop_token_ids(tokenizer, fmt.end_of_conversation_token))
    cfg = GenerationConfig(max_new_tokens=args.max_answer_seq_len, stop_ids=stop_ids, pad_id=tokenizer.pad_token_id,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    masks, logprobs = [], []
    with torch.no_grad():
        for i in range(0, len(prompts), args.batch_size):
            ids = [formatter.encode(formatter.prompt_text(q)) for q in prompts[i:i + args.batch_size]]
            enc = tokenizer.pad({"input_ids": ids}, return_tensors="pt")
            out = sample(policy, enc.input_ids, enc.attention_mask, cfg)
            lp = policy_logprobs(reference, out.seq, out.attention_mask, out.prompt_width)
            pad = args.max_answer_seq_len - lp.shape[1]
            masks.append(torch.nn.functional.pad(out.answer_mask, (0, pad)))
            logprobs.append(torch.nn.functional.pad(lp, (0, pad)))
    mask, lp = torch.cat(masks), torch.cat(logprobs)
    rows = split_table(mask, lp, args.thresholds)
    length = mask.sum(1).double().mean().item()
    print(f"{mask.shape[0]} answers of {args.policy} (mean {length:.1f} tokens), probabilities under "
          f"{args.reference or args.policy}, from {prompts_file}")
    print(f"{'rule':<18}{'actions/answer':>16}{'tokens/action':>15}")
    for r in rows:
        print(f"{r['rule']:<18}{r['actions_per_answer']:>16.2f}{r['tokens_per_action']:>15.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"answers": mask.shape[0], "mean_answer_tokens": length,
                                              "low_probability_tokens": {f"{t:g}": float(
                                                  ((lp < math.log(t)) & mask).sum()) for t in args.thresholds},
                                              "rows": rows, "settings": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
