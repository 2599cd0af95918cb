"""Macro-action termination rules and segment aggregation (MA-RLHF paper §3.2.1, App. B.4, D.1).

Every termination rule returns a boolean ``starts`` tensor (B, T) marking the first token of each macro
action; :func:`segments_from_starts` turns it into per-sample segment ids ``seg`` (B, T) (0, 1, 2, ... on
real tokens, -1 on padding). Everything downstream (values, rewards, GAE, losses) is a scatter/gather over
the flattened index ``b * M + seg``, so each sample gets its own boundaries and nothing is ever averaged
across the batch (both were defects of the released code, see docs/design.md "Macro actions, precisely").

Conventions: per-token tensors are response-only, shape (B, T) with right padding; ``mask`` (B, T) marks
real tokens, contiguous from k = 0 to T_b - 1 (T_b may be 0). Macro tensors are (B, M), M = max number of
macro actions in the batch, with ``macro_mask`` (B, M). Only torch and math are imported.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

SIGMAS = ("equal", "unit", "position")
REWARD_MODES = ("sum", "compat")


class MacroBatch(NamedTuple):
    """Segment layout of one batch; built once per rollout by :func:`macro_batch`."""

    seg: torch.Tensor  # (B, T) long, -1 on padding
    macro_mask: torch.Tensor  # (B, M) bool
    lengths: torch.Tensor  # (B, M) long, 0 on padding


def check_choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {', '.join(valid)}")


def check_mask(mask: torch.Tensor, field: str = "mask") -> torch.Tensor:
    """Return ``mask`` as bool after checking it is right-padded (real tokens contiguous from k = 0).

    Left padding or holes would silently shift every macro boundary, so they are an error naming the row.
    """
    if mask.dim() != 2:
        raise ValueError(f"{field}: expected shape (B, T), got {tuple(mask.shape)}")
    m = mask.bool()  # (B, T)
    if m.shape[1] > 1:
        bad = (m[:, 1:] & ~m[:, :-1]).any(dim=1)  # (B,) a real token after padding
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise ValueError(f"{field}: row {row} is not right-padded (real tokens start at 0, no holes)")
    return m


def segments_from_starts(starts: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Segment ids from macro-action start flags: cumsum(starts) - 1 on real tokens, -1 on padding.

    Position 0 is always a start (a sample's first token opens its first macro action); starts on
    padding are ignored. All termination rules go through here so the id convention lives in one place.
    """
    m = check_mask(mask)  # (B, T)
    if starts.shape != m.shape:
        raise ValueError(f"starts: shape {tuple(starts.shape)} != mask shape {tuple(m.shape)}")
    s = starts.bool() & m  # (B, T)
    if s.shape[1] > 0:
        s[:, 0] = m[:, 0]
    seg = torch.cumsum(s.long(), dim=1) - 1  # (B, T)
    return torch.where(m, seg, torch.full_like(seg, -1))  # (B, T)


def _lengths_of(mask: torch.Tensor) -> torch.Tensor:
    return mask.long().sum(dim=1)  # (B,) T_b


def fixed_starts(mask: torch.Tensor, n: float | None) -> torch.Tensor:
    """Fixed n-gram termination (§3.2.1 (a)): seg = k // n.

    n = 1 is vanilla token-level PPO; n None, 0 or math.inf gives one macro action per sample (the
    |ω| → ∞ limit of §3.2.3, as with ``--ngram 0``).
    """
    m = check_mask(mask)  # (B, T)
    T = m.shape[1]
    k = torch.arange(T, device=m.device)  # (T,)
    if n is None or n == 0 or n == math.inf:
        return (k == 0).unsqueeze(0) & m  # (B, T)
    if isinstance(n, bool) or not math.isfinite(n) or n != int(n) or n < 1:
        raise ValueError(f"ngram n={n!r} must be a positive integer, or None/0/inf for one macro action")
    return (k % int(n) == 0).unsqueeze(0) & m  # (B, T)


def randomized_starts(
    mask: torch.Tensor,
    lengths: tuple[int, ...] | list[int] = (2, 3, 5, 10),
    repeat_times: int = 3,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Randomized n-gram termination (§3.2.1 (b), App. B.4).

    The list ``lengths`` repeated ``repeat_times`` times is shuffled independently for every sample
    (``torch.rand(B, L, generator).argsort(-1)`` — one draw per call, so the same seeded generator gives
    the same boundaries); macro actions take these lengths in order and whatever remains after the whole
    list is one last macro action (the paper's "large number" filling the gap).
    """
    m = check_mask(mask)  # (B, T)
    B, T = m.shape
    if repeat_times < 1 or len(lengths) == 0 or any(int(x) != x or x < 1 for x in lengths):
        raise ValueError(
            f"randomized lengths={lengths!r} must be positive integers and repeat_times={repeat_times} >= 1"
        )
    pool = torch.tensor(list(lengths) * repeat_times, dtype=torch.long)  # (L,)
    L = pool.numel()
    gen_device = generator.device if generator is not None else torch.device("cpu")
    perm = torch.rand(B, L, generator=generator, device=gen_device).argsort(dim=1)  # (B, L)
    lens = pool.to(gen_device)[perm].to(m.device)  # (B, L) per-sample shuffled lengths
    ends = torch.cumsum(lens, dim=1).clamp(max=T)  # (B, L) start of the next macro action
    starts = torch.zeros(B, T + 1, dtype=torch.bool, device=m.device)  # (B, T+1), column T is a sink
    starts[:, 0] = True
    starts.scatter_(1, ends, True)
    return starts[:, :T] & m  # (B, T)


PPL_CHUNK_ELEMENTS = 1 << 24  # (B, chunk, W) temporaries of _ppl_next: 16 M x 9 bytes = 151 MB at most


def _ppl_next(
    x: torch.Tensor, S: torch.Tensor, m: torch.Tensor, Tb: torch.Tensor, W: int,
    chunk_elements: int = PPL_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """nxt(s) for every candidate start s looking at most W tokens ahead → (nxt, capped), both (B, T).

    ``capped[b, s]``: no token in the window raised the mean although the sample goes on past s + W, so
    nxt(s) = s + W was decided by the window, not by the rule.  The candidate starts are processed in
    blocks of ``chunk_elements // (B·W)`` so the float64 and bool (B, block, W) temporaries never exceed
    ``chunk_elements`` entries (9 bytes each) however far the look-ahead has grown: the worst case W = T =
    2048 at B = 64 would otherwise need 2.3 GB.  Each block is computed exactly as the whole would be.
    """
    B, T = m.shape
    dev = m.device
    # -inf past a sample's end: x_t · d = -inf never exceeds the sum, so no break is found there
    x_cond = torch.cat([torch.where(m, x, -math.inf), x.new_full((B, W), -math.inf)], dim=1)  # (B, T+W)
    S_ext = torch.cat([S, S[:, -1:].expand(B, W)], dim=1)  # (B, T+W+1), S_k for k > T stays S_T
    x_win = x_cond[:, 1:].unfold(1, W, 1)  # (B, T, W) view: x_win[b, s, d-1] = x_{s+d}
    S_win = S_ext[:, 1:].unfold(1, W, 1)[:, :T]  # (B, T, W) view: S_win[b, s, d-1] = S_{s+d}
    d = torch.arange(1, W + 1, device=dev, dtype=torch.float64)  # (W,) = t - s
    natural_last = torch.empty(B, T, dtype=torch.bool, device=dev)  # (B, T)
    first = torch.empty(B, T, dtype=torch.long, device=dev)  # (B, T)
    block = max(1, chunk_elements // max(B * W, 1))
    for a in range(0, T, block):  # a handful of blocks, each vectorised over its starts and the window
        z = slice(a, min(a + block, T))
        # break at t = s + d  ⟺  x_t · d > S_t - S_s  ⟺  S_t - x_t · d < S_s   (one float64 temporary)
        brk = torch.addcmul(S_win[:, z], x_win[:, z], d, value=-1.0) < S[:, z, None]  # (B, block, W)
        natural_last[:, z] = brk[:, :, W - 1]
        brk[:, :, W - 1] = True  # the window's end is a forced break
        first[:, z] = brk.view(torch.uint8).argmax(dim=2)  # first break (argmax returns the first maximum)
        del brk
    s = torch.arange(T, device=dev)  # (T,)
    capped = (first == W - 1) & ~natural_last & (s[None, :] + W < Tb[:, None])  # (B, T)
    nxt = torch.minimum(s[None, :] + first + 1, Tb[:, None])  # (B, T) a sample's last macro ends at T_b
    nxt = torch.where(s[None, :] < Tb[:, None], nxt, torch.full_like(nxt, T))  # (B, T) past the end → sink
    return nxt, capped


def _chain_from_zero(nxt: torch.Tensor) -> torch.Tensor:
    """Members of the chain 0, nxt(0), nxt(nxt(0)), ... per row by pointer doubling → (B, T+1) bool.

    R ← R ∪ J(R), J ← J∘J: after r rounds R = {nxt^k(0) : k < 2^r}, so ceil(log2(T+1)) rounds cover any
    chain (a loop over doubling rounds, not over tokens).
    """
    B, T = nxt.shape
    dev = nxt.device
    J = torch.cat([nxt, torch.full((B, 1), T, dtype=torch.long, device=dev)], dim=1)  # (B, T+1) sink T → T
    R = torch.zeros(B, T + 1, dtype=torch.bool, device=dev)  # (B, T+1)
    R[:, 0] = True
    for _ in range(max(1, math.ceil(math.log2(T + 1)))):
        hit = torch.zeros(B, T + 1, dtype=torch.int32, device=dev).scatter_add_(1, J, R.int())  # (B, T+1)
        R = R | (hit > 0)
        J = J.gather(1, J)
    return R


def ppl_starts(
    mask: torch.Tensor, ref_logprobs: torch.Tensor, max_len: int | None = None, window: int = 32,
    chunk_elements: int = PPL_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Perplexity-based termination (§3.2.1): a macro action ends before the token that would raise its ppl.

    With x_k = -log p_ref(a_k) and ppl(ω) ∝ mean of x over ω, a macro action started at s takes token t
    while x_t <= mean(x_s..x_{t-1}) (equality keeps the mean, so the paper's >= lets it continue) and the
    next macro action starts at the first t where x_t > mean(x_s..x_{t-1}). ``max_len`` optionally caps
    the length of a macro action (None: the paper's rule, uncapped).

    Vectorisation: the rule is a chain s_0 = 0, s_{j+1} = nxt(s_j), and nxt(s) depends only on s, so
    (1) nxt(s) is computed for every candidate start s at once from prefix sums S, using the cross-
    multiplied test x_t · (t - s) > S_t - S_s in float64 (exact for fp32/bf16/fp16 inputs of ordinary
    magnitude — ties are decided exactly, no division); (2) the chain's members are found by pointer
    doubling. Uncapped, the look-ahead starts at ``window`` tokens and doubles (up to T) only while some
    macro action ON the chain reached the window's end with its sample still going, so the result is
    exact and the usual cost is that of a short window: O(B·T·W) time and memory with one float64 and
    one bool (B, T, W) temporary (W = 32: 8 MB + 1 MB at B = 64, T = 512), plus O(B·T·log T) for the
    doubling. Memory is bounded whatever the text: a long run of non-increasing surprisal (repetitive text)
    grows W toward T, and the temporaries are then built ``chunk_elements`` entries at a time (151 MB at
    the default; without the bound W = T = 2048 at B = 64 needs 2.3 GB).
    """
    m = check_mask(mask)  # (B, T)
    B, T = m.shape
    if ref_logprobs.shape != m.shape:
        raise ValueError(f"ref_logprobs: shape {tuple(ref_logprobs.shape)} != mask shape {tuple(m.shape)}")
    if max_len is not None and max_len < 1:
        raise ValueError(f"ppl max_len={max_len} must be >= 1 or None")
    if window < 1:
        raise ValueError(f"ppl window={window} must be >= 1")
    if T == 0:
        return m.clone()
    Tb = _lengths_of(m)  # (B,)
    x = torch.where(m, -ref_logprobs.detach().double(), 0.0)  # (B, T) token surprisal
    bad = ~torch.isfinite(x)  # (B, T)
    if bool(bad.any()):
        b, k = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"ref_logprobs: row {b}, position {k} is not finite ({float(ref_logprobs[b, k])})")
    S = torch.cat([x.new_zeros(B, 1), torch.cumsum(x, dim=1)], dim=1)  # (B, T+1) exclusive prefix sums
    if max_len is not None:  # the cap is part of the rule: one pass with W = max_len
        nxt, _ = _ppl_next(x, S, m, Tb, min(int(max_len), T), chunk_elements)
        return _chain_from_zero(nxt)[:, :T] & m  # (B, T)
    W = min(window, T)
    while True:  # at most log2(T / window) + 1 passes over window sizes
        nxt, capped = _ppl_next(x, S, m, Tb, W, chunk_elements)
        R = _chain_from_zero(nxt)  # (B, T+1)
        if W >= T or not bool((capped & R[:, :T]).any()):
            return R[:, :T] & m  # (B, T)
        W = min(2 * W, T)


def lowprob_starts(mask: torch.Tensor, logprobs: torch.Tensor, threshold: float) -> torch.Tensor:
    """Low-probability termination: a macro action ends at a token whose probability is below ``threshold``
    (log p < log τ), so the next token starts a new one.  With the reference model's log-probabilities this is
    Segmental Advantage Estimation's split (arXiv 2601.07320): GAE bootstraps only at such forking tokens.
    Padding is ignored; a low-probability last token ends the answer's last action as any last token does."""
    m = check_mask(mask)  # (B, T)
    if logprobs.shape != m.shape:
        raise ValueError(f"logprobs: shape {tuple(logprobs.shape)} != mask shape {tuple(m.shape)}")
    if not 0 < threshold < 1:
        raise ValueError(f"lowprob threshold={threshold!r} must be in (0, 1)")
    low = (logprobs.double() < math.log(threshold)) & m  # (B, T) tokens that end their action
    starts = torch.zeros_like(m)
    if m.shape[1]:
        starts[:, 0] = m[:, 0]
        starts[:, 1:] = low[:, :-1] & m[:, 1:]
    return starts


def word_starts(mask: torch.Tensor, input_ids: torch.Tensor, word_start_table: torch.Tensor) -> torch.Tensor:
    """One macro action per word: a token flagged in ``word_start_table`` (V,) bool opens a new macro action.

    This is the "reversing tokenization" view of macro actions; the table comes from the tokenizer
    (e.g. tokens whose text begins with a space marker).
    """
    m = check_mask(mask)  # (B, T)
    if input_ids.shape != m.shape:
        raise ValueError(f"input_ids: shape {tuple(input_ids.shape)} != mask shape {tuple(m.shape)}")
    V = word_start_table.shape[0]
    ids = torch.where(m, input_ids.long(), 0)  # (B, T) padding ids may be anything
    bad = ((ids < 0) | (ids >= V)) & m  # (B, T)
    if bool(bad.any()):
        b, k = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"input_ids: row {b}, position {k} has id {int(ids[b, k])} outside word_start_table size {V}"
        )
    return word_start_table.to(m.device).bool()[ids] & m  # (B, T)


def split_last_token(starts: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Compatibility mode: make each sample's last real token its own macro action (released code).

    The released code keeps the final token apart so that σ-weighted rewards do not average away the
    RM score sitting on it; use together with ``macro_rewards(..., mode="compat")``.
    """
    m = check_mask(mask)  # (B, T)
    T = m.shape[1]
    k = torch.arange(T, device=m.device)  # (T,)
    last = k[None, :] == (_lengths_of(m) - 1)[:, None]  # (B, T) never true for empty samples
    return (starts.bool() | last) & m  # (B, T)


def num_macros(seg: torch.Tensor) -> torch.Tensor:
    """Number of macro actions per sample, (B,) long (0 for an empty sample)."""
    if seg.shape[1] == 0:
        return torch.zeros(seg.shape[0], dtype=torch.long, device=seg.device)
    return seg.max(dim=1).values + 1  # (B,)


def _flat_index(seg: torch.Tensor, M: int) -> torch.Tensor:
    """Index b*M + seg for real tokens and the sink B*M for padding: one scatter covers the batch."""
    B = seg.shape[0]
    if seg.numel() and int(seg.max()) >= M:
        raise ValueError(f"seg: max segment id {int(seg.max())} does not fit M={M}")
    rows = torch.arange(B, device=seg.device)[:, None] * M  # (B, 1)
    return torch.where(seg >= 0, rows + seg, torch.full_like(seg, B * M))  # (B, T)


def segment_sum(x: torch.Tensor, seg: torch.Tensor, M: int) -> torch.Tensor:
    """Σ of x over each macro action: (B, T) → (B, M), padding dropped via a sink slot."""
    B = seg.shape[0]
    idx = _flat_index(seg, M).reshape(-1)  # (B*T,)
    out = x.new_zeros(B * M + 1).index_add(0, idx, x.reshape(-1))  # (B*M+1,)
    return out[: B * M].reshape(B, M)  # (B, M)


def macro_lengths(seg: torch.Tensor, M: int | None = None) -> torch.Tensor:
    """|ω| for every macro action, (B, M) long, 0 past a sample's last macro action."""
    if M is None:
        M = int(num_macros(seg).max()) if seg.shape[0] else 0
    return segment_sum((seg >= 0).long(), seg, M)  # (B, M)


def macro_batch(seg: torch.Tensor, M: int | None = None) -> MacroBatch:
    """Bundle seg with its (B, M) macro mask and lengths (M defaults to the batch's max count)."""
    lengths = macro_lengths(seg, M)  # (B, M)
    return MacroBatch(seg=seg, macro_mask=lengths > 0, lengths=lengths)


def to_tokens(macro_x: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """Broadcast a macro quantity (B, M) back to its tokens (B, T); 0 on padding (App. E)."""
    if macro_x.shape[1] == 0:
        return macro_x.new_zeros(seg.shape)
    out = macro_x.gather(1, seg.clamp(min=0))  # (B, T)
    return torch.where(seg >= 0, out, torch.zeros_like(out))  # (B, T)


def token_weights(seg: torch.Tensor, sigma: str, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """σ_i for every token (App. D.1), float64 (B, T), 0 on padding; each macro action's σ sums to 1.

    equal: 1/|ω|; unit: 1 on the last token; position: σ_i = 1/((|ω| - i)·H), H = Σ_{j=1}^{|ω|} 1/j,
    which grows toward the end of the macro action (the released code's weights decrease instead).
    """
    check_choice("value_function (sigma)", sigma, SIGMAS)
    if lengths is None:
        lengths = macro_lengths(seg)  # (B, M)
    real = seg >= 0  # (B, T)
    L = to_tokens(lengths, seg)  # (B, T) |ω| of the token's macro action
    if sigma == "equal":
        w = 1.0 / L.clamp(min=1).double()  # (B, T)
    else:
        first = torch.cumsum(lengths, dim=1) - lengths  # (B, M) index of each macro action's first token
        k = torch.arange(seg.shape[1], device=seg.device)  # (T,)
        rest = L - (k[None, :] - to_tokens(first, seg))  # (B, T) |ω| - i, 1 on the last token
        if sigma == "unit":
            w = (rest == 1).double()  # (B, T)
        else:
            T = seg.shape[1]
            harmonic = torch.cumsum(1.0 / torch.arange(1, T + 1, device=seg.device, dtype=torch.float64), 0)
            H = harmonic[(L - 1).clamp(min=0)]  # (B, T) H_{|ω|}
            w = 1.0 / (rest.clamp(min=1).double() * H)  # (B, T)
    return torch.where(real, w, torch.zeros_like(w))  # (B, T)


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def macro_values(
    values: torch.Tensor, seg: torch.Tensor, mask: torch.Tensor, sigma: str = "equal"
) -> tuple[torch.Tensor, torch.Tensor]:
    """V(ω) = Σ_i σ_i V_i per macro action of each sample (App. D.1) → (B, M) values, (B, M) macro_mask.

    Computed per sample with one scatter (never averaged over the batch); dtype at least float32.
    """
    macros = macro_batch(seg)
    w = token_weights(seg, sigma, macros.lengths)  # (B, T)
    x = torch.where(mask.bool(), values.to(torch.float64) * w, 0.0)  # (B, T)
    M = macros.lengths.shape[1]
    return segment_sum(x, seg, M).to(_acc_dtype(values)), macros.macro_mask  # (B, M), (B, M)


def macro_rewards(
    rewards: torch.Tensor, seg: torch.Tensor, mask: torch.Tensor, mode: str = "sum", sigma: str = "equal"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Macro reward R(ω) per macro action → (B, M) rewards, (B, M) macro_mask.

    "sum": the paper's R_τ = Σ_i ρ^i r_{t_τ+i} with ρ = 1 (§3.2.2). "compat": the released code's
    σ-weighted reward (use with :func:`split_last_token` so the RM score keeps its own macro action).
    """
    check_choice("reward_mode", mode, REWARD_MODES)
    check_choice("value_function (sigma)", sigma, SIGMAS)
    macros = macro_batch(seg)
    x = torch.where(mask.bool(), rewards.to(torch.float64), 0.0)  # (B, T)
    if mode == "compat":
        x = x * token_weights(seg, sigma, macros.lengths)  # (B, T)
    M = macros.lengths.shape[1]
    return segment_sum(x, seg, M).to(_acc_dtype(rewards)), macros.macro_mask  # (B, M), (B, M)
