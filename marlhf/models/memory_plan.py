"""How much accelerator memory each rank of a step needs, planned from the model configs before any weight loads.

Every step prints this plan at its start (rank 0) and refuses one that cannot fit the device (``--memory_check``),
naming flags that would make it fit; ``--plan_only`` prints it and exits.  The numbers per rank are:

* **Model states** of each model (:func:`model_states`).  Trained models follow DeepSpeed's own estimators
  (``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs``, mixed precision:
  16-bit parameters plus 18 bytes per parameter of 16-bit and fp32 gradients, fp32 master weights and Adam's two
  moments), extended to the cases they leave out and documented here: ZeRO-0 (nothing partitioned) and ZeRO-1
  (16-bit gradients whole, the other 16 bytes partitioned), fp32 training (4-byte parameters and gradients, no
  master copy: 16 bytes in all), and LoRA (the optimizer side counts the trainable parameters only).  Frozen
  models (reference, reward, EMA) hold their weights only, partitioned at ZeRO-3 (plus DeepSpeed's gathered
  largest layer) and on the CPU with parameter offload.
* **Activations** kept for backward of one training micro-batch (:func:`activation_bytes`), an approximation
  after Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4.1: 34·sbh +
  5·as²b bytes per layer in 16-bit), with the MLP term scaled to the model's intermediate size, the attention
  scores only for eager attention (SDPA / flash attention keep none), and with gradient checkpointing each
  layer's input plus one layer recomputed; plus the logits the loss reads.
* **Generation's KV cache** (step 3, :func:`kv_cache_bytes`): rows × (prompt + answer) × layers × 2 ×
  key-value heads × head dim × bytes, so grouped-query attention counts its few key-value heads.

The peak is the model states plus the largest of the transient terms (generation and training do not overlap).
What is left out: the CUDA context and allocator fragmentation (:data:`HEADROOM_BYTES` is kept free for them),
DeepSpeed's communication buckets, and a tokenizer's few added embedding rows.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

log = logging.getLogger("marlhf")

GiB = 2 ** 30
# kept free on the device for the CUDA context, NCCL buffers and allocator fragmentation
HEADROOM_BYTES = 2 * GiB
# DeepSpeed's additional_buffer_factor default: host memory is over-provisioned by this much in its estimates
CPU_BUFFER_FACTOR = 1.5
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


# --------------------------------------------------------------------------------------------------------
# model shapes: parameter counts from the config, on the meta device (no weights)
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: parameter counts and the dimensions activations and the cache scale with."""

    params: int  # all parameters, a tied embedding counted once
    largest_layer: int  # the most parameters one module holds itself (DeepSpeed's ZeRO-3 gather term)
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    lora_params: int = 0  # parameters LoRA adds (the trainable ones with --only_optimize_lora)


def _text_config(cfg):
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def shape_of(cfg, value_head: bool = False, lora_dim: int = 0, lora_modules: str = "") -> ModelShape:
    """The :class:`ModelShape` of a transformers config: the model is built on the meta device (no memory, no
    weights), as a causal LM or with ``value_head`` a one-label sequence classifier (reward model / critic)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cfg = dataclasses.replace(cfg) if dataclasses.is_dataclass(cfg) else type(cfg).from_dict(cfg.to_dict())
    with torch.device("meta"):
        if value_head:
            cfg.num_labels = 1
            model = AutoModelForSequenceClassification.from_config(cfg)
        else:
            model = AutoModelForCausalLM.from_config(cfg)
    params = sum(p.numel() for p in model.parameters())  # parameters() yields a shared tensor once
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    lora = _lora_params(model, lora_dim, lora_modules) if lora_dim > 0 else 0
    text = _text_config(cfg)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return ModelShape(params=params, largest_layer=largest, layers=text.num_hidden_layers, hidden=text.hidden_size,
                      intermediate=getattr(text, "intermediate_size", None) or 4 * text.hidden_size, heads=heads,
                      kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim,
                      vocab=text.vocab_size, lora_params=lora)


def _lora_params(model, dim: int, module_names: str) -> int:
    """Parameters LoRA of rank ``dim`` adds: r·(in + out) per adapted Linear (the layers apply_lora picks)."""
    from marlhf.models.lora import lora_targets

    targets = set(lora_targets(model, module_names))
    return sum(dim * (m.in_features + m.out_features) for name, m in model.named_modules() if name in targets)


def shape_of_folder(path: str, value_head: bool = False, lora_dim: int = 0, lora_modules: str = "") -> ModelShape:
    """:func:`shape_of` a model folder's (or hub name's) config.json."""
    from transformers import AutoConfig

    return shape_of(AutoConfig.from_pretrained(path), value_head, lora_dim, lora_modules)


# --------------------------------------------------------------------------------------------------------
# the pure functions: bytes per rank
# --------------------------------------------------------------------------------------------------------
def model_states(shape: ModelShape, *, trained: bool, zero_stage: int, world_size: int, dtype: str,
                 offload: bool = False, offload_params: bool | None = None, lora_only: bool = False,
                 cpu_buffer_factor: float = CPU_BUFFER_FACTOR) -> tuple[int, int]:
    """(accelerator bytes per rank, host bytes per node) of one model's parameters, gradients and optimizer state.

    ``offload``: the optimizer state on the CPU (ZeRO 1-3); ``offload_params`` (default: ``offload``): at ZeRO-3
    the parameters too, as ``--offload`` does.  Mixed precision (bf16 / fp16) at ZeRO-2 and ZeRO-3 is DeepSpeed's
    estimator, to the byte (tests/test_memory_plan.py); the host column is its estimate too (a single node).

    Per parameter, mixed precision: 2 bytes of 16-bit weights, then 18 of optimizer side (2 + 4 bytes of 16-bit and
    fp32 gradients, 4 of fp32 master weights, 8 of Adam's moments; 16 at ZeRO-3, whose 16-bit gradients are
    reduce-scattered into the fp32 partition).  fp32: 4 bytes of weights, 12 of optimizer side (4 gradients, 8
    Adam).  ZeRO-1 partitions the optimizer side but the 16-bit (fp32: the) gradients, ZeRO-2 all of it, ZeRO-3
    the weights too, gathering one layer at a time (DeepSpeed counts 4 bytes per parameter of the largest).
    LoRA with ``lora_only``: the optimizer side of the adapters only; the base weights count as frozen."""
    n = max(world_size, 1)
    offload_params = offload if offload_params is None else offload_params
    mixed = dtype in ("bf16", "fp16")
    wbytes = 2 if mixed else 4
    gathered = 4 * shape.largest_layer if zero_stage == 3 else 0
    total = shape.params + shape.lora_params  # LoRA adds its adapters to the weights
    weights = wbytes * total
    if not trained:
        if zero_stage < 3:
            return weights, 0
        if offload_params:
            return gathered, int(weights * cpu_buffer_factor)
        return gathered + int(weights / n), 0
    trainable = shape.lora_params if lora_only else total
    grad16 = 2 if mixed else 4  # the gradients in the weights' dtype (fp32: the only ones)
    side = (18 if mixed else 12) if zero_stage < 3 else (16 if mixed else 12)
    if zero_stage == 0:
        return weights + side * trainable, 0
    if zero_stage == 1:
        if offload:
            return weights + grad16 * trainable, int(trainable * max(4 * n, 16) * cpu_buffer_factor)
        return weights + grad16 * trainable + int((side - grad16) * trainable / n), 0
    if zero_stage == 2:
        if offload:  # estimate_zero2_model_states_mem_needs, cpu_offload=True
            return weights, int(trainable * max(4 * n, 16) * cpu_buffer_factor)
        return weights + int(side * trainable / n), int(total * 4 * n * cpu_buffer_factor)
    # ZeRO-3: estimate_zero3_model_states_mem_needs (one node, zero_init=True: the model built partitioned)
    if offload and offload_params:
        return gathered, int((weights + side * trainable) * cpu_buffer_factor)
    if offload:
        return gathered + int(weights / n), int(side * trainable * cpu_buffer_factor)
    return gathered + int((weights + side * trainable) / n), int(shape.largest_layer * 4 * n * cpu_buffer_factor)


def activation_bytes(shape: ModelShape, *, rows: int, seq_len: int, dtype: str, checkpointing: bool,
                     eager_attention: bool = False, logits: bool = True, logit_positions: int | None = None) -> int:
    """Bytes kept for backward by one training micro-batch of ``rows`` sequences of ``seq_len`` tokens.

    A stated approximation (Korthikanti et al. 2022, §4.1, per layer in 16-bit: 34·sbh + 5·as²b): 18·sbh for the
    attention block, norms and residuals, 4·sbI for the MLP (16·sbh at I = 4h), 5·as²b for eager attention's
    scores, softmax and dropout mask (SDPA and flash attention keep none); fp32 doubles it.  Gradient
    checkpointing keeps each layer's input (2·sbh) and recomputes one layer at a time.  ``logits``: the
    vocabulary-wide logits the loss reads, in the run's dtype (the chunked log-probs keep no fp32 copy), at
    ``logit_positions`` per row (default all; step 3 projects the answer's only)."""
    b = _DTYPE_BYTES[dtype]
    tokens = rows * seq_len
    per_layer = tokens * (18 * shape.hidden + 4 * shape.intermediate) * b // 2
    if eager_attention:
        per_layer += 5 * shape.heads * seq_len * tokens * b // 2
    layers = shape.layers * tokens * shape.hidden * b + per_layer if checkpointing else shape.layers * per_layer
    positions = seq_len if logit_positions is None else logit_positions
    return layers + (rows * positions * shape.vocab * b if logits else 0)


def kv_cache_bytes(shape: ModelShape, *, rows: int, seq_len: int, dtype: str) -> int:
    """Generation's key-value cache: rows × tokens × layers × 2 (key, value) × key-value heads × head dim × bytes
    (Gemma-2's sliding-window layers keep at most their window, 4096 tokens: the same for every launch script)."""
    return rows * seq_len * shape.layers * 2 * shape.kv_heads * shape.head_dim * _DTYPE_BYTES[dtype]


# --------------------------------------------------------------------------------------------------------
# a step's plan
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelLine:
    role: str
    params: int
    trainable: int
    zero_stage: int
    dtype: str
    offload: str  # "-", "optimizer", "params+optimizer", "params"
    gpu: int
    cpu: int


@dataclass(frozen=True)
class Plan:
    """Bytes per rank: each model's states, the transient terms (name -> bytes), and the peak."""

    step: str
    world_size: int
    models: tuple[ModelLine, ...]
    transient: dict

    @property
    def model_state_bytes(self) -> int:
        return sum(m.gpu for m in self.models)

    @property
    def peak(self) -> int:
        return self.model_state_bytes + max(self.transient.values(), default=0)

    @property
    def cpu(self) -> int:
        """Host memory of the offloaded states (DeepSpeed's estimate, per node)."""
        return sum(m.cpu for m in self.models if m.offload != "-")


def engine_stage(zero_stage: int, dtype: str) -> int:
    """The stage a trained model's optimizer runs at: bf16 at --zero_stage 0 runs as ZeRO-1
    (:func:`marlhf.utils.ds_engine.optimizer_zero_stage`, which logs it; equal in tests/test_memory_plan.py)."""
    return 1 if zero_stage == 0 and dtype == "bf16" else zero_stage


def _model_line(role: str, shape: ModelShape, *, trained: bool, zero_stage: int, world_size: int, dtype: str,
                offload: bool = False, lora_only: bool = False) -> ModelLine:
    if trained:
        zero_stage = engine_stage(zero_stage, dtype)
    gpu, cpu = model_states(shape, trained=trained, zero_stage=zero_stage, world_size=world_size, dtype=dtype,
                            offload=offload, lora_only=lora_only)
    where = "-"
    if offload:
        where = ("params+optimizer" if zero_stage == 3 else "optimizer") if trained else "params"
    total = shape.params + shape.lora_params
    trainable = (shape.lora_params if lora_only else total) if trained else 0
    return ModelLine(role, total, trainable, zero_stage, dtype, where, gpu, cpu)


def _eager(attn: str) -> bool:
    return attn == "eager"


def plan_supervised(step: str, shape: ModelShape, *, world_size: int, dtype: str, zero_stage: int, offload: bool,
                    batch: int, seq_len: int, checkpointing: bool, lora_only: bool = False, attn: str = "sdpa",
                    reference: ModelShape | None = None, logits: bool = True) -> Plan:
    """Steps 1 and 2 (SFT, reward model, DPO): the trained model (and DPO's frozen reference) and one micro-batch's
    activations (pairs run as 2 × batch sequences: step 2 and DPO score chosen and rejected together)."""
    rows = batch * (2 if step in ("rm", "dpo") else 1)
    role = {"sft": "policy", "rm": "reward model", "dpo": "policy"}[step]
    models = [_model_line(role, shape, trained=True, zero_stage=zero_stage, world_size=world_size, dtype=dtype,
                          offload=offload, lora_only=lora_only)]
    if reference is not None:
        models.append(_model_line("reference", reference, trained=False, zero_stage=zero_stage, world_size=world_size,
                                  dtype=dtype))
    act = activation_bytes(shape, rows=rows, seq_len=seq_len, dtype=dtype, checkpointing=checkpointing,
                           eager_attention=_eager(attn), logits=logits)
    return Plan(step, world_size, tuple(models), {f"activations ({rows} x {seq_len} tokens)": act})


def plan_rlhf(shapes: dict, *, world_size: int, dtype: str, actor_zero_stage: int, critic_zero_stage: int,
              offload: bool, offload_reference_model: bool, generation_rows: int, training_rows: int,
              prompt_len: int, answer_len: int, actor_checkpointing: bool, critic_checkpointing: bool,
              lora_only: bool = False, attn: str = "sdpa") -> Plan:
    """Step 3: ``shapes`` maps actor / critic / reward / ema (those present) to their :class:`ModelShape`; the
    reference is the actor's.  Frozen models follow their trained model's stage, or ZeRO-3 with parameter
    offload under --offload_reference_model (``frozen_zero_stage``)."""
    actor = shapes["actor"]
    ref_stage = 3 if offload_reference_model else actor_zero_stage
    reward_stage = 3 if offload_reference_model else critic_zero_stage
    models = [_model_line("actor", actor, trained=True, zero_stage=actor_zero_stage, world_size=world_size,
                          dtype=dtype, offload=offload, lora_only=lora_only),
              _model_line("reference", dataclasses.replace(actor, lora_params=0), trained=False, zero_stage=ref_stage,
                          world_size=world_size, dtype=dtype, offload=offload_reference_model)]
    if "ema" in shapes:
        models.append(_model_line("EMA (fp32)", shapes["ema"], trained=False, zero_stage=ref_stage,
                                  world_size=world_size, dtype="fp32", offload=offload_reference_model))
    if "critic" in shapes:
        models.append(_model_line("critic", shapes["critic"], trained=True, zero_stage=critic_zero_stage,
                                  world_size=world_size, dtype=dtype, offload=offload, lora_only=lora_only))
    if "reward" in shapes:
        models.append(_model_line("reward model", shapes["reward"], trained=False, zero_stage=reward_stage,
                                  world_size=world_size, dtype=dtype, offload=offload_reference_model))
    seq = prompt_len + answer_len
    transient = {
        f"KV cache ({generation_rows} x {seq} tokens)": kv_cache_bytes(actor, rows=generation_rows, seq_len=seq,
                                                                       dtype=dtype),
        # one forward of the policy over the generation batch: the answer positions' logits (rollout.policy_logprobs)
        f"experience logits ({generation_rows} x {answer_len})":
            generation_rows * answer_len * actor.vocab * _DTYPE_BYTES[dtype],
        f"actor activations ({training_rows} x {seq})": activation_bytes(
            actor, rows=training_rows, seq_len=seq, dtype=dtype, checkpointing=actor_checkpointing,
            eager_attention=_eager(attn), logit_positions=answer_len),
    }
    if "critic" in shapes:
        transient[f"critic activations ({training_rows} x {seq})"] = activation_bytes(
            shapes["critic"], rows=training_rows, seq_len=seq, dtype=dtype, checkpointing=critic_checkpointing,
            eager_attention=_eager(attn), logits=False)
    return Plan("ppo", world_size, tuple(models), transient)


def plan_eval(shapes: dict, *, world_size: int, dtype: str, zero_stage: int, offload: bool, generation_rows: int,
              prompt_len: int, answer_len: int) -> Plan:
    """``marlhf eval-policy``: the policy, reference and reward model (those in ``shapes``) frozen as step 3's
    reference is (``zero_stage``: --actor_zero_stage; ``offload``: --offload_reference_model), and generation."""
    roles = {"policy": "policy", "reference": "reference", "reward": "reward model"}
    stage = 3 if offload else zero_stage
    models = [_model_line(label, shapes[key], trained=False, zero_stage=stage, world_size=world_size, dtype=dtype,
                          offload=offload) for key, label in roles.items() if key in shapes]
    seq = prompt_len + answer_len
    policy = shapes["policy"]
    transient = {f"KV cache ({generation_rows} x {seq} tokens)": kv_cache_bytes(policy, rows=generation_rows,
                                                                                seq_len=seq, dtype=dtype),
                 f"answer logits ({generation_rows} x {answer_len})":
                     generation_rows * answer_len * policy.vocab * _DTYPE_BYTES[dtype]}
    return Plan("eval", world_size, tuple(models), transient)


# --------------------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------------------
def gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def format_plan(plan: Plan, device_bytes: int | None = None) -> str:
    """The plan as a text table: a row per model, a row per transient term, the peak and the verdict."""
    rows = [("model", "params", "trained", "ZeRO", "dtype", "offload", "per GPU", "host (node)")]
    for m in plan.models:
        rows.append((m.role, f"{m.params / 1e9:.3g}B" if m.params >= 1e8 else f"{m.params / 1e6:.3g}M",
                     "-" if not m.trainable else (f"{m.trainable / 1e6:.3g}M" if m.trainable < m.params else "all"),
                     str(m.zero_stage), m.dtype, m.offload, gib(m.gpu), gib(m.cpu) if m.offload != "-" else "-"))
    biggest = max(plan.transient, key=plan.transient.get, default=None)
    for name, value in plan.transient.items():
        rows.append((name, "", "", "", "", "", gib(value), "peak" if name == biggest else ""))
    rows.append((f"peak per rank ({plan.world_size} rank{'s' if plan.world_size > 1 else ''})", "", "", "", "", "",
                 gib(plan.peak), ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"memory plan, step {plan.step} (model states + the largest transient term; docs/gpu.md):"]
    lines += ["  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
              for r in rows]
    if device_bytes is None:
        lines.append("  device: no accelerator (not checked)")
    else:
        verdict = "fits" if fits(plan, device_bytes) else "DOES NOT FIT"
        lines.append(f"  device: {gib(device_bytes)} per GPU, {gib(HEADROOM_BYTES)} kept free: {verdict}")
    return "\n".join(lines)


def fits(plan: Plan, device_bytes: int) -> bool:
    return plan.peak + HEADROOM_BYTES <= device_bytes


def device_memory_bytes(override_gb: float = 0.0) -> int | None:
    """The memory of this rank's accelerator (``override_gb`` > 0: that many GiB, to plan for another machine);
    None without one (a CPU run is not checked: host memory is shared with the OS and other processes, and the
    runs there are small)."""
    if override_gb > 0:
        return int(override_gb * GiB)
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def planned_world_size(flag: int = 0) -> int:
    """The ranks the plan divides over: ``--plan_world_size``, else the launched world."""
    if flag > 0:
        return flag
    from marlhf.utils import dist

    return max(dist.world_size(), int(os.environ.get("WORLD_SIZE", "1")))


# --------------------------------------------------------------------------------------------------------
# a step's plan from its flags; the check every step runs before loading weights
# --------------------------------------------------------------------------------------------------------
def _attn_of(cfg, requested: str, dtype: str, value_head: bool = False) -> str:
    from marlhf.models.loading import resolve_attn_implementation, torch_dtype

    # a class transformers does not map: its own choice, planned as SDPA (no attention scores kept)
    return resolve_attn_implementation(cfg, requested, torch_dtype(dtype), value_head) or "sdpa"
