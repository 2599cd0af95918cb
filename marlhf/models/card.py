"""Turn a step's output folder into a clean, self-describing Hugging Face folder with a model card.

A step output holds the exported model (step 1: causal LM, step 2: reward model, step 3: ``actor/``,
``critic/`` and maybe ``actor_ema/``), the run's flags (``args.json``, written by ``setup_run``), its
metrics (``metrics.jsonl``), logs and DeepSpeed checkpoints.  :func:`export_step_output` copies only what
inference needs — weights as safetensors, config with the KV cache on, tokenizer, a generation config that
stops at the recorded end-of-conversation token, ``conversation_format.json`` — and writes a README.md
naming base model, data, step, flags and final metrics.  A folder holding a peft LoRA adapter instead of
merged weights is merged onto its base model first.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from marlhf.data.formatting import FORMAT_FILE, write_format
from marlhf.errors import ConfigError
from marlhf.models.heads import attach_likelihood_term
from marlhf.models.loading import (
    load_causal_lm,
    load_tokenizer_and_format,
    load_value_model,
    resolve_model_path,
    stop_token_ids,
    torch_dtype,
)
from marlhf.models.lora import apply_lora
from marlhf.utils.run import recorded_value

log = logging.getLogger("marlhf")

STEP_NAMES = {1: "supervised fine-tuning (step 1)", 2: "reward model (step 2)", 3: "MA-PPO RLHF (step 3)"}
STEP3_MODELS = ("actor", "critic", "actor_ema")


@dataclass
class StepOutput:
    model_dir: Path  # the folder with the model's weights (or its LoRA adapter)
    run_dir: Path  # the folder with args.json / metrics.jsonl
    step: int
    role: str  # "policy" | "reward model" | "actor" | "critic" | "actor_ema"
    adapter_only: bool  # a peft adapter without merged weights next to it
    checkpoint: str = ""  # the DeepSpeed checkpoint engine folder the weights come from, if any


def _has_weights(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (any(folder.glob("*.safetensors")) or any(folder.glob("*.bin")))


def _is_adapter(folder: Path) -> bool:
    return (folder / "adapter_config.json").is_file()


def locate(folder: str | Path, model: str = "actor") -> StepOutput:
    """Which model of which step ``folder`` holds; a ConfigError saying what is missing otherwise.  ``model``
    picks one of step 3's models (actor, critic, actor_ema)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder}: no such folder (give the --output_dir of a training step)")
    if model not in STEP3_MODELS:
        raise ConfigError(f"--model must be one of {', '.join(STEP3_MODELS)}, got {model!r}")
    # args.json sits in the step's --output_dir: the folder, or up to two levels above (actor/lora_adapter)
    run_dir = next((d for d in (folder, folder.parent, folder.parent.parent) if (d / "args.json").is_file()),
                   folder)
    args = _read_args(run_dir)
    if "actor_model_name_or_path" in args or any((folder / m).is_dir() for m in STEP3_MODELS):
        target = folder / model if (folder / model).is_dir() else folder
        if target == folder:  # given <out>/critic itself, or <out>/critic/lora_adapter
            model = next((d.name for d in (folder, folder.parent) if d.name in STEP3_MODELS), model)
        if not (_has_weights(target) or _is_adapter(target)):
            raise ConfigError(f"{folder}: a step-3 output without a finished {model!r} model (no {model}/config.json"
                              f" and safetensors; the run may have stopped before exporting — export its DeepSpeed "
                              f"checkpoint with --from_checkpoint)")
        return StepOutput(target, run_dir, 3, model, not _has_weights(target))
    if _has_weights(folder) or _is_adapter(folder):
        adapter_only = not _has_weights(folder)
        if adapter_only:  # peft records the head: SEQ_CLS for a reward model, CAUSAL_LM for a policy
            is_rm = json.loads((folder / "adapter_config.json").read_text()).get("task_type") == "SEQ_CLS"
        else:
            arch = json.loads((folder / "config.json").read_text()).get("architectures") or []
            is_rm = any(a.endswith("ForSequenceClassification") for a in arch)
        return StepOutput(folder, run_dir, 2 if is_rm else 1, "reward model" if is_rm else "policy", adapter_only)
    hint = ""
    if (folder / "checkpoints").is_dir() or (folder / "latest").is_file():
        hint = " (only DeepSpeed checkpoints: export them with --from_checkpoint)"
    raise ConfigError(f"{folder} is not a training step's output: no config.json with safetensors weights, no "
                      f"LoRA adapter_config.json, no actor/ or critic/ folder{hint}")


def _read_args(run_dir: Path) -> dict:
    path = run_dir / "args.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None


def final_metrics(run_dir: Path) -> dict[str, tuple[int, float]]:
    """The last logged value of every metric in ``metrics.jsonl``, with the step it was logged at."""
    path = run_dir / "metrics.jsonl"
    out: dict[str, tuple[int, float]] = {}
    if not path.is_file():
        return out
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            log.warning("%s: line %d is not JSON (a run killed mid-write?); skipped", path, n)
            continue
        for key, value in row.items():
            if key not in ("step", "time") and isinstance(value, (int, float)):
                out[key] = (row.get("step", -1), value)
    return out


def base_model_of(recorded: dict, step: int) -> str:
    """The model a step started from, as its ``args.json`` records it."""
    key = "actor_model_name_or_path" if step == 3 else "model_name_or_path"
    if recorded.get(key):
        return recorded[key]
    resolved = recorded_value(recorded, key)
    return "the embedded default tiny model (marlhf.embedded" + (f", {resolved})" if resolved else ")")


def render_model_card(src: StepOutput, recorded: dict, metrics: dict[str, tuple[int, float]], eot: str,
                      prompt_format: str) -> str:
    data = recorded.get("data_path") or []
    lines = [f"# {src.model_dir.resolve().name}: MA-RLHF {STEP_NAMES[src.step]} — {src.role}", "",
             f"- **Step:** {src.step} — {STEP_NAMES[src.step]}",
             f"- **Model:** {src.role}",
             f"- **Base model:** `{base_model_of(recorded, src.step)}`"]
    if src.step == 3:
        critic = recorded_value(recorded, "critic_model_name_or_path") or "?"
        lines.append(f"- **Reward model / critic init:** `{critic}`")
    lines += [f"- **Data:** {', '.join(f'`{d}`' for d in data) if data else 'not recorded'}"
              + (f" (split `{recorded['data_split']}`)" if recorded.get("data_split") else ""),
              f"- **End-of-conversation token:** `{eot!r}`; **prompt format:** `{prompt_format}`",
              f"- **Source:** `{src.model_dir.resolve()}`" + (" (LoRA adapter merged)" if src.adapter_only else "")
              + (f" (DeepSpeed checkpoint `{src.checkpoint}`)" if src.checkpoint else ""),
              "", "## Final metrics", ""]
    if metrics:
        lines += ["| metric | value | step |", "|---|---|---|"]
        lines += [f"| {k} | {v:.6g} | {s} |" for k, (s, v) in sorted(metrics.items())]
    else:
        lines.append("No metrics.jsonl was found beside the model.")
    lines += ["", "## Training flags", ""]
    if recorded:
        lines += ["```json", json.dumps(recorded, indent=1, sort_keys=True), "```"]
    else:
        lines.append("Not recorded (no args.json beside the model).")
    cls = "AutoModelForSequenceClassification" if src.role in ("reward model", "critic") else "AutoModelForCausalLM"
    lines += ["", "## Use", "", "```python", f"from transformers import {cls}, AutoTokenizer", "",
              "tok = AutoTokenizer.from_pretrained(PATH)",
              f"model = {cls}.from_pretrained(PATH)  # generation stops at the recorded end token", "```", ""]
    if src.role == "reward model" and recorded.get("likelihood_term"):
        lines += ["This reward model was trained with `--likelihood_term`: its score adds α · Σ log p(answer token) "
                  "under a next-token head stored beside the score head (`likelihood.*` weights).  Plain "
                  "transformers loads the score head alone; `marlhf.models.loading.load_reward_model(PATH, tok)` "
                  "loads both, as step 3 and the evaluation tools do.", ""]
    return "\n".join(lines)


def _load(src: StepOutput, base_model: str, tok, dtype):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    is_value = src.role in ("reward model", "critic")
    cls = AutoModelForSequenceClassification if is_value else AutoModelForCausalLM
    if not src.adapter_only:
        if is_value and json.loads((src.model_dir / "config.json").read_text()).get("likelihood_term"):
            from marlhf.models.loading import load_reward_model

            return load_reward_model(str(src.model_dir), tok, dtype=dtype)  # with its likelihood term
        return cls.from_pretrained(src.model_dir, dtype=dtype)
    from peft import PeftModel

    adapter_cfg = json.loads((src.model_dir / "adapter_config.json").read_text())
    base = base_model or adapter_cfg.get("base_model_name_or_path") or ""
    if not base:
        raise ConfigError(f"{src.model_dir}: a LoRA adapter without a recorded base model; give --base_model")

    extra = {"num_labels": 1} if is_value else {}
    model = cls.from_pretrained(resolve_model_path(base), dtype=dtype, **extra)
    if model.get_input_embeddings().weight.shape[0] < len(tok):
        model.resize_token_embeddings(len(tok))
    log.info("merging LoRA adapter %s onto %s", src.model_dir, base)
    return PeftModel.from_pretrained(model, src.model_dir).merge_and_unload()


# ------------------------------------------------------------------------------ from a DeepSpeed checkpoint
ENGINE_OF = {"actor": "actor", "critic": "critic", "actor_ema": "ema"}  # step 3's model -> checkpoint engine


def locate_checkpoint(folder: str | Path, model: str = "actor") -> StepOutput:
    """The checkpoint engine folder to export: ``folder`` is a step's --output_dir (its latest checkpoint), its
    ``checkpoints/`` folder, one ``checkpoints/stepNNNNNNNN`` folder, or one engine folder inside it."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder}: no such folder (give a step's --output_dir or its checkpoints/ folder)")
    if (folder / "checkpoints" / "latest").is_file():
        folder = folder / "checkpoints"
    if (folder / "latest").is_file():
        folder = folder / (folder / "latest").read_text().strip()
    if any(folder.glob("*model_states.pt")):  # an engine folder itself
        engine_dir = folder
    elif (folder / "trainer_state.json").is_file():
        engines = sorted(d.name for d in folder.iterdir() if d.is_dir() and any(d.glob("*model_states.pt")))
        if set(engines) & set(ENGINE_OF.values()):  # step 3: actor, critic (, ema)
            if ENGINE_OF[model] not in engines:
                raise ConfigError(f"{folder} has no {model!r} engine checkpoint (it has {', '.join(engines)})")
            engine_dir = folder / ENGINE_OF[model]
        elif engines:
            engine_dir = folder / engines[0]
        else:
            raise ConfigError(f"{folder}: a checkpoint without DeepSpeed model files (*model_states.pt)")
    else:
        raise ConfigError(f"{folder} holds no DeepSpeed checkpoint (no checkpoints/latest, latest, trainer_state.json "
                          f"or *model_states.pt)")
    step_dir = engine_dir.parent
    run_dir = next((d for d in (step_dir.parent.parent, step_dir.parent, step_dir) if (d / "args.json").is_file()),
                   step_dir.parent.parent)
    args = _read_args(run_dir)
    name = engine_dir.name
    if "actor_model_name_or_path" in args or name in ("actor", "critic", "ema"):
        step, role = 3, {"ema": "actor_ema"}.get(name, name)
    else:
        step, role = (2, "reward model") if name == "reward" else (1, "policy")
    return StepOutput(engine_dir, run_dir, step, role, False, checkpoint=f"{step_dir.name}/{name}")


def checkpoint_state_dict(engine_dir: Path) -> dict[str, torch.Tensor]:
    """Full weights of one engine's checkpoint on CPU: ZeRO 1-3 partitions merged by DeepSpeed's own
    zero_to_fp32 (fp32 master weights), or the ZeRO-0 model file's state dict."""
    if any(engine_dir.glob("*optim_states.pt")) and any(engine_dir.glob("zero_pp_rank_*")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(str(engine_dir.parent), tag=engine_dir.name))
    if any(engine_dir.glob("zero_pp_rank_*")):  # partitioned, but no optimizer partitions to merge
        raise ConfigError(f"{engine_dir}: ZeRO-partitioned weights without optimizer states (a frozen engine such "
                          f"as the EMA under ZeRO-3): the checkpoint does not hold its full weights; export the "
                          f"run's exported folder instead")
    files = sorted(engine_dir.glob("mp_rank_*_model_states.pt"))
    if not files:
        raise ConfigError(f"{engine_dir}: no mp_rank_*_model_states.pt")
    return torch.load(files[0], map_location="cpu", weights_only=False)["module"]


def _model_from_checkpoint(src: StepOutput, base_model: str, default_base: Callable[[], str] | None = None):
    """(model with the checkpoint's weights, LoRA merged; tokenizer; format), rebuilt as the run built it from
    its recorded flags (args.json): base model, end token, prompt format, added tokens, LoRA.  ``default_base``:
    the model an empty recorded path stands for (the entry point passes the embedded default's)."""

    args = _read_args(src.run_dir)
    if not args and not base_model:
        raise ConfigError(f"{src.run_dir}: no args.json beside the checkpoint; give --base_model (the model the "
                          f"run started from)")
    state = checkpoint_state_dict(src.model_dir)  # first: a checkpoint that cannot be read fails before any load
    is_value = src.role in ("reward model", "critic")
    key = ("critic_model_name_or_path" if is_value else "actor_model_name_or_path") if src.step == 3 \
        else "model_name_or_path"
    base = base_model or recorded_value(args, key, "")
    if src.step == 3 and is_value and not base_model and not base:
        # as step 3 built it: without a reward model (gold scorer, program tests) the critic starts from the actor
        uses_rm = args.get("reward_source", "reward_model") in ("reward_model", "rm")
        base = "" if uses_rm else recorded_value(args, "actor_model_name_or_path", "")
    tok_base = recorded_value(args, "actor_model_name_or_path", "") if src.step == 3 and not base_model else base
    if not (base and tok_base):  # a run recorded before run contexts existed left the embedded model's path empty
        if default_base is None:
            raise ConfigError(f"{src.run_dir}/args.json records no base model; give --base_model")
        base, tok_base = base or default_base(), tok_base or default_base()
    tok, fmt = load_tokenizer_and_format(tok_base, recorded_value(args, "end_of_conversation_token", ""),
                                         recorded_value(args, "prompt_format", "auto"),
                                         add_eot_token=bool(args.get("add_eot_token", False)))
    if is_value:
        model = load_value_model(base, tok)
        if any(k.startswith("likelihood.") for k in state):  # step 2 with --likelihood_term
            attach_likelihood_term(model, args.get("likelihood_norm", "sum"))
    else:
        model = load_causal_lm(base, tok, end_of_conversation_token=fmt.end_of_conversation_token)
    if src.step == 3 and src.role == "critic":
        lora_dim, modules = args.get("critic_lora_dim", 0), args.get("critic_lora_module_name", "")
    elif src.step == 3:
        lora_dim = args.get("actor_lora_dim", 0) or args.get("lora_dim", 0)
        modules = args.get("actor_lora_module_name", "") or args.get("lora_module_name", "")
    else:
        lora_dim, modules = args.get("lora_dim", 0), args.get("lora_module_name", "")
    if lora_dim and src.role != "actor_ema":  # the EMA tracks the full weights (no LoRA)
        model = apply_lora(model, lora_dim, modules, True, task="SEQ_CLS" if is_value else "CAUSAL_LM")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {n for n in missing if n.endswith("lm_head.weight") and getattr(model.config, "tie_word_embeddings", False)}
    absent = sorted(set(missing) - tied)
    if unexpected or absent:
        raise ConfigError(f"{src.model_dir}: the checkpoint does not fit the model rebuilt from "
                          f"{base or 'the embedded default'} (missing {absent[:4]}, unexpected "
                          f"{sorted(unexpected)[:4]}); give --base_model if the run started from another model")
    if hasattr(model, "merge_and_unload"):
        log.info("merging the LoRA weights of %s", src.model_dir)
        model = model.merge_and_unload()
    return model, tok, fmt


def export_step_output(folder: str | Path, out_dir: str | Path, model: str = "actor", base_model: str = "",
                       dtype: str = "auto", overwrite: bool = False, from_checkpoint: bool = False,
                       default_base: Callable[[], str] | None = None) -> Path:
    """Write ``folder``'s model as a clean HF folder with a README.md model card into ``out_dir``.
    ``from_checkpoint``: take the weights from the run's (latest, or the given) DeepSpeed checkpoint instead
    of its exported model — for a run stopped before its export; ZeRO partitions are merged, LoRA merged;
    ``default_base`` builds the model a recorded empty base path stands for."""

    src = locate_checkpoint(folder, model) if from_checkpoint else locate(folder, model)
    out_dir = Path(out_dir)
    if out_dir.resolve() == src.model_dir.resolve() or src.model_dir.resolve() in out_dir.resolve().parents:
        raise ConfigError(f"--output_dir {out_dir} must not be the source folder or inside it")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ConfigError(f"{out_dir} exists and is not empty (give --overwrite to replace it)")
    if from_checkpoint:
        hf, tok, fmt = _model_from_checkpoint(src, base_model, default_base)
        if dtype != "auto":
            hf = hf.to(torch_dtype(dtype))
    else:
        tok_dir = src.model_dir
        if src.adapter_only and not (src.model_dir / "tokenizer_config.json").is_file():
            tok_dir = src.model_dir.parent  # export_hf keeps the adapter in <model>/lora_adapter/
        if not (tok_dir / "tokenizer_config.json").is_file() and not (tok_dir / "tokenizer.json").is_file():
            raise ConfigError(f"{src.model_dir}: no tokenizer saved with the model")
        tok, fmt = load_tokenizer_and_format(str(tok_dir))
        if not (tok_dir / FORMAT_FILE).is_file():
            log.warning("%s: no %s; recording the tokenizer's own end token %r", tok_dir, FORMAT_FILE,
                        fmt.end_of_conversation_token)
        torch_type = "auto" if dtype == "auto" else torch_dtype(dtype)
        hf = _load(src, base_model, tok, torch_type)
    hf = hf.eval()
    hf.config.use_cache = True
    hf.config.pad_token_id = tok.pad_token_id
    if src.role not in ("reward model", "critic") and hf.generation_config is not None:
        hf.generation_config.pad_token_id = tok.pad_token_id
        hf.generation_config.eos_token_id = stop_token_ids(tok, fmt.end_of_conversation_token)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    with torch.no_grad():
        hf.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    write_format(out_dir, fmt)
    args = _read_args(src.run_dir)
    card = render_model_card(src, args, final_metrics(src.run_dir), fmt.end_of_conversation_token,
                             fmt.prompt_format)
    (out_dir / "README.md").write_text(card)
    log.info("exported %s (step %d %s) to %s", src.model_dir, src.step, src.role, out_dir)
    return out_dir
