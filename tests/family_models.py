"""Tiny models of the launch scripts' architectures, for running the per-size scripts at their own flags on CPU
ranks: each real config (tests/fixtures/model_configs, the public config.json values) shrunk to a few layers of
width 64 — same model class, attention kind (grouped-query heads in the real ratio), soft-capping, RoPE scaling
and tied embeddings — over the embedded tokenizer with the family's end-of-text token added.  And a local
TL;DR (``openai/summarize_from_feedback``) dataset in that dataset's own row format, written from the embedded
task's posts and summaries, large enough for the scripts' global batches."""

from __future__ import annotations

import json
from pathlib import Path

CONFIGS = Path(__file__).parent / "fixtures" / "model_configs"
# script family -> (real config, its end-of-text token as the launch scripts name it)
FAMILIES = {"gemma-2b": ("gemma-2b", "<eos>"), "gemma-7b": ("gemma-7b", "<eos>"),
            "gemma2-27b": ("gemma2-27b", "<eos>"), "llama3.2-3b": ("llama3.2-3b", "<|end_of_text|>")}
WIDTH, HEAD_DIM, LAYERS = 64, 16, 2


def tiny_config(name: str, vocab_size: int, eos_id: int, pad_id: int, bos_id: int) -> dict:
    cfg = json.loads((CONFIGS / name / "config.json").read_text())
    heads = 4
    kv = max(1, heads * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) // cfg["num_attention_heads"])
    cfg.update(vocab_size=vocab_size, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
               num_attention_heads=heads, num_key_value_heads=kv, head_dim=HEAD_DIM, eos_token_id=eos_id,
               pad_token_id=pad_id, bos_token_id=bos_id, torch_dtype="float32", dtype="float32")
    if "query_pre_attn_scalar" in cfg:  # Gemma-2 scales queries by 1/sqrt(this): the head size, as in the 2B/9B
        cfg["query_pre_attn_scalar"] = HEAD_DIM
    if "sliding_window" in cfg:
        cfg["sliding_window"] = 32  # shorter than the runs' sequences: the sliding layers really slide
    return cfg


def build(family: str, out: Path) -> Path:
    """The tiny model of ``family`` saved in ``out`` (built once per folder)."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from marlhf import embedded

    name, eos = FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(embedded.prepare().model_dir)
    tok.add_special_tokens({"eos_token": eos})
    if tok.pad_token is None or tok.pad_token == eos:
        tok.add_special_tokens({"pad_token": "<pad>"})
    cfg_dict = tiny_config(name, len(tok), tok.eos_token_id, tok.pad_token_id, tok.bos_token_id or tok.eos_token_id)
    model_type = cfg_dict.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **{k: v for k, v in cfg_dict.items() if k != "architectures"})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def tldr_dataset(out: Path, rows: int = 3000) -> Path:
    """``rows`` TL;DR comparison rows (train) and 200 (validation) in ``openai/summarize_from_feedback``'s format,
    from the embedded task: the post, a good summary and a worse one (the task's own candidates)."""
    if (out / "train.jsonl").exists():
        return out
    from marlhf.embedded.task import SyntheticConfig, generate

    out.mkdir(parents=True, exist_ok=True)
    records = generate(SyntheticConfig(seed=11, num_records=rows + 200))
    for split, part in (("train", records[:rows]), ("validation", records[rows:])):
        with open(out / f"{split}.jsonl", "w") as f:
            for i, r in enumerate(part):
                post = r.prompt.split("POST: ", 1)[-1].rsplit("\nTL;DR:", 1)[0]  # the dataset's post: no template
                row = {"info": {"id": f"{split}{i}", "post": post, "title": "a post",
                                "subreddit": "synthetic", "site": None, "article": None},
                       "summaries": [{"text": " " + r.chosen, "policy": "ref", "note": None},
                                     {"text": " " + r.rejected, "policy": "ref", "note": None}],
                       "choice": 0, "worker": "w", "batch": "b", "split": split, "extra": {"confidence": 7}}
                f.write(json.dumps(row) + "\n")
    return out


def apps_dataset(out: Path, rows: int = 400) -> Path:
    """``rows`` APPS problems (train) and 40 (test) in ``codeparrot/apps``' row format — question, solutions and
    input_output as JSON strings, starter code, difficulty — from the generated code task (its formulas, tests
    and reference programs)."""
    if (out / "train.jsonl").exists():
        return out
    from marlhf.embedded.code_task import SyntheticCodeConfig, generate

    out.mkdir(parents=True, exist_ok=True)
    records = generate(SyntheticCodeConfig(num_records=rows + 40))
    for split, part in (("train", records[:rows]), ("test", records[rows:])):
        with open(out / f"{split}.jsonl", "w") as f:
            for i, r in enumerate(part):
                starter = r.meta.get("starter_code") or ""
                question = r.prompt.split("QUESTION:\n", 1)[1].rsplit("\nUse ", 1)[0]
                if starter and question.endswith(starter):  # the prompt appends the starter code; the row does not
                    question = question[:-len(starter)].rstrip("\n")
                row = {"problem_id": i, "question": question, "difficulty": "introductory",
                       "solutions": json.dumps([r.chosen]), "url": "", "starter_code": starter,
                       "input_output": json.dumps(r.meta["input_output"])}
                f.write(json.dumps(row) + "\n")
    return out
