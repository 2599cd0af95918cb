"""What every reward source the user writes must return: one finite number per response (:func:`check_rewards`);
a wrong count, a non-number, nan or inf stops the run with a :class:`~marlhf.errors.RewardError` naming who
answered, rather than training the policy on something the user never wrote."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

from marlhf.errors import RewardError


def check_rewards(values, responses: Sequence[str], who: str) -> list[float]:
    """``values`` as one finite float per response, else a :class:`RewardError` saying what is wrong.

    Accepted: a list or tuple of numbers (bools count as 0 / 1; numpy and 0-d torch scalars too) or a 1-d
    numpy array / torch tensor.  ``who`` names the source in the message (``--reward_function f.py:score``)."""
    n = len(responses)
    if hasattr(values, "detach"):  # a torch tensor: off the graph and the device first
        values = values.detach().cpu()
    if not isinstance(values, (list, tuple)) and hasattr(values, "tolist") and hasattr(values, "shape"):
        if len(values.shape) != 1:
            raise RewardError(f"{who}: returned an array of shape {tuple(values.shape)}; expected one reward per "
                              f"response, shape ({n},)")
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardError(f"{who}: returned {type(values).__name__}; expected a list of {n} numbers, one per "
                          f"response")
    if len(values) != n:
        raise RewardError(f"{who}: returned {len(values)} rewards for {n} responses")
    out = []
    for i, v in enumerate(values):
        if not isinstance(v, numbers.Real) and hasattr(v, "item") and getattr(v, "ndim", 0) == 0:
            v = v.item()  # a 0-d tensor / numpy scalar inside a list
        if not isinstance(v, numbers.Real):
            raise RewardError(f"{who}: reward {i} is {short(v)} ({type(v).__name__}), not a number "
                              f"(response {i}: {short(responses[i])})")
        f = float(v)
        if not math.isfinite(f):
            raise RewardError(f"{who}: reward {i} is {f} (response {i}: {short(responses[i])})")
        out.append(f)
    return out


def short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
