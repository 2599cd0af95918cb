"""DPO and IPO: preference optimisation of the policy against a frozen reference, without a reward model.

The baseline of MA-RLHF App. C.3 (Table 7): trained on the reward model's preference split, the policy
and the reference both initialised from the SFT model. With π_θ the policy, π_ref the reference and, per
pair, the log-ratio margin

    h = [log π_θ(y⁺|x) − log π_ref(y⁺|x)] − [log π_θ(y⁻|x) − log π_ref(y⁻|x)]

(log π(y|x) summed over the response tokens only):

    sigmoid (DPO, Rafailov et al., 2023, eq. 7):   L = −log σ(β h)
    ipo     (IPO, Azar et al., 2023, eq. 17):      L = (h − 1/(2β))²

β r(x, y) = β (log π_θ(y|x) − log π_ref(y|x)) is DPO's implicit reward; its mean on chosen and rejected
answers, their margin and the share of pairs ordered correctly (h > 0) are what is logged.

The loss maths are pure tensor functions; :func:`dpo_objective` plugs them into the one training loop of
steps 1-2 (:func:`marlhf.supervised.train`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from marlhf.data.pipeline import SFTCollator
from marlhf.models.forward import labelled_logits
from marlhf.models.logprobs import token_logprobs
from marlhf.rlhf.macro import check_choice
from marlhf.supervised import Objective, pair_count, pair_length
from marlhf.utils.optim_step import all_reduce_sum

LOSSES = ("sigmoid", "ipo")


# --------------------------------------------------------------------------------------------------------
# pure maths
# --------------------------------------------------------------------------------------------------------
def sequence_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Σ_t log π(x_t | x_<t) over the tokens whose target is not -100 (the response; prompt and padding are
    -100, as :class:`marlhf.data.pipeline.SFTCollator` writes its labels).  logits (B, K, V) with column j
    predicting targets[:, j] (B, K): the labels shifted by one, as :func:`labelled_logits` returns them.
    → (B,) in float32 (or wider)."""
    real = targets != -100
    picked = token_logprobs(logits, targets.clamp(min=0))  # (B, K), chunked: no float32 (B, K, V) copy kept
    return torch.where(real, picked, 0.0).sum(dim=1)


def preference_loss(
    kind: str,
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean DPO (``kind="sigmoid"``) or IPO (``"ipo"``) loss over the pairs, from sequence log-probs (B,).

    Stats (detached): chosen_reward / rejected_reward (mean β·log-ratio), margin (mean β·h), accuracy (share of
    pairs with h > 0)."""
    check_choice("dpo_loss", kind, LOSSES)
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    chosen = policy_chosen - ref_chosen.detach()  # (B,) log π_θ/π_ref on y⁺
    rejected = policy_rejected - ref_rejected.detach()  # (B,)
    h = chosen - rejected  # (B,)
    if kind == "sigmoid":
        losses = -F.logsigmoid(beta * h)
    else:
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    with torch.no_grad():
        stats = {"chosen_reward": (beta * chosen).mean(), "rejected_reward": (beta * rejected).mean(),
                 "margin": (beta * h).mean(), "accuracy": (h > 0).to(losses.dtype).mean()}
    return losses.mean(), stats


# --------------------------------------------------------------------------------------------------------
# data and the objective of the shared loop
# --------------------------------------------------------------------------------------------------------
class DPOCollator:
    """Chosen sequences over rejected ones, rows [0, B) chosen and [B, 2B) rejected (as the reward model's
    :class:`marlhf.data.pipeline.PairCollator`), with labels that are -100 on the prompt and on padding."""

    def __init__(self, pad_id: int):
        self.sft = SFTCollator(pad_id)

    def __call__(self, batch: list[dict]) -> dict:
        rows = [{"input_ids": b["chosen_ids"], "response_start": b["chosen_start"]} for b in batch]
        rows += [{"input_ids": b["rejected_ids"], "response_start": b["rejected_start"]} for b in batch]
        return self.sft(rows)


def labelled_logprobs(model, batch: dict) -> torch.Tensor:
    """Σ log π of each row's labelled (response) tokens in an :class:`~marlhf.data.pipeline.SFTCollator`
    batch: (B,).  Only the columns that predict a labelled token are projected (:func:`labelled_logits`)."""
    return sequence_logprobs(*labelled_logits(model, batch))


def pair_logprobs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Response log-probs of the chosen and rejected halves of a :class:`DPOCollator` batch: (B,), (B,)."""
    return labelled_logprobs(model, batch).chunk(2)


def dpo_objective(pad_id: int, reference, beta: float, kind: str = "sigmoid"):
    """The :class:`marlhf.supervised.Objective` of DPO/IPO against the frozen ``reference`` engine."""
    check_choice("dpo_loss", kind, LOSSES)

    def loss(model, batch: dict):
        with torch.no_grad():
            ref_c, ref_r = pair_logprobs(reference, batch)
        pol_c, pol_r = pair_logprobs(model, batch)
        value, stats = preference_loss(kind, pol_c, pol_r, ref_c, ref_r, beta)
        return value, {"loss": value.detach(), **stats}  # tensors: the loop reads them once per step

    @torch.no_grad()
    def evaluate(model, loader) -> dict:
        """Pair-weighted means over the evaluation pairs of every rank: loss, implicit rewards, accuracy."""
        model.eval()
        keys = ("loss", "chosen_reward", "rejected_reward", "margin", "accuracy")
        total = torch.zeros(len(keys) + 1, dtype=torch.float64)
        for batch in loader:
            ref_c, ref_r = pair_logprobs(reference, batch)
            pol_c, pol_r = pair_logprobs(model, batch)
            value, stats = preference_loss(kind, pol_c, pol_r, ref_c, ref_r, beta)
            n = pol_c.shape[0]
            total += torch.tensor([value.item() * n] + [stats[k].item() * n for k in keys[1:]] + [n],
                                  dtype=torch.float64)
        model.train()
        total = all_reduce_sum(total)
        count = total[-1].clamp(min=1)
        return {k: (total[i] / count).item() for i, k in enumerate(keys)}

    return Objective("dpo", DPOCollator(pad_id), loss, evaluate, pair_count, pair_length)
