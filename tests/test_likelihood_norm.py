"""The reward model's likelihood term with --likelihood_norm mean (issue 28: the summed term prefers shorter answers,
and a step-3 policy learned to drop facts for it): α times the mean log-probability of the answer's tokens so far,
checked against a loop over positions; the norm is recorded in the model's config and kept on reload."""

import pytest
import torch

from marlhf.config import RewardArgs, parse_args
from marlhf.errors import ConfigError
from marlhf.models.heads import LikelihoodTerm


def loop_term(term: LikelihoodTerm, hidden, ids, mask, start, norm):
    """Per row and position: α · (Σ or mean) of log p(answer token) over the answer's tokens up to there."""
    B, T = ids.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    alpha = float(term.scale.detach())
    for b in range(B):
        total, count = 0.0, 0
        for t in range(T):
            if t >= int(start[b]) and t >= 1 and bool(mask[b, t]):
                logits = hidden[b, t - 1].double() @ term.lm_head.weight.detach().double().T
                total += float(logits.log_softmax(-1)[ids[b, t]])
                count += 1
            out[b, t] = alpha * (total / max(count, 1) if norm == "mean" else total)
    return out


@pytest.mark.parametrize("norm", ["sum", "mean"])
def test_the_term_equals_the_loop(norm):
    g = torch.Generator().manual_seed(0)
    term = LikelihoodTerm(8, 11, norm)
    with torch.no_grad():
        term.lm_head.weight.copy_(torch.randn(11, 8, generator=g))
        term.scale.fill_(0.7)
    B, T = 3, 9
    hidden = torch.randn(B, T, 8, generator=g)
    ids = torch.randint(0, 11, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 6:] = 0  # right padding
    start = torch.tensor([3, 2, 5])
    with torch.no_grad():
        got = term(hidden, ids, mask, start).double()
    torch.testing.assert_close(got, loop_term(term, hidden, ids, mask, start, norm), rtol=1e-4, atol=1e-4)


def test_mean_removes_the_length_bias_of_the_sum():
    """Two answers whose every token has the same probability: the sum ranks the longer one lower, the mean ties."""
    term = LikelihoodTerm(4, 5, "mean")
    with torch.no_grad():
        term.lm_head.weight.zero_()  # every token p = 1/5
    hidden = torch.zeros(2, 10, 4)
    ids = torch.zeros(2, 10, dtype=torch.long)
    mask = torch.tensor([[1] * 10, [1] * 6 + [0] * 4])
    start = torch.tensor([2, 2])
    with torch.no_grad():
        mean = term(hidden, ids, mask, start)
        term.norm = "sum"
        total = term(hidden, ids, mask, start)
    last = [9, 5]
    assert mean[0, last[0]] == pytest.approx(mean[1, last[1]]) == pytest.approx(torch.log(torch.tensor(0.2)).item())
    assert total[0, last[0]] < total[1, last[1]]  # 8 terms against 4


def test_the_norm_is_recorded_and_kept_on_reload(embedded, tmp_path):
    from marlhf.models.loading import load_reward_model, load_tokenizer

    tok = load_tokenizer(str(embedded.model_dir))
    model = load_reward_model(str(embedded.model_dir), tok, likelihood_term=True, likelihood_norm="mean")
    assert model.likelihood.norm == "mean" and model.config.likelihood_norm == "mean"
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again = load_reward_model(str(tmp_path), tok)  # the folder's term keeps its norm
    assert again.likelihood.norm == "mean"
    assert load_reward_model(str(embedded.model_dir), tok, likelihood_term=True).likelihood.norm == "sum"
    with pytest.raises(ConfigError, match="--likelihood_norm and --likelihood_scale are for --likelihood_term"):
        parse_args(RewardArgs, ["--likelihood_norm", "mean"])
    assert parse_args(RewardArgs, ["--likelihood_term", "--likelihood_norm", "mean"])[0].likelihood_norm == "mean"


def test_likelihood_scale_starts_alpha_and_mean_at_length_l_equals_the_sum(embedded, tmp_path):
    """--likelihood_scale L with the mean term: a fresh term's α is L, so an answer of L tokens scores exactly what
    the summed term with α = 1 gives it; a folder's term keeps its learnt α; the flag is refused without the term."""
    from marlhf.models.loading import load_reward_model, load_tokenizer

    tok = load_tokenizer(str(embedded.model_dir))
    mean = load_reward_model(str(embedded.model_dir), tok, likelihood_term=True, likelihood_norm="mean",
                             likelihood_scale=6.0).eval()
    total = load_reward_model(str(embedded.model_dir), tok, likelihood_term=True).eval()
    assert float(mean.likelihood.scale) == 6.0 and float(total.likelihood.scale) == 1.0
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, len(tok), (2, 10), generator=g)
    mask = torch.ones(2, 10, dtype=torch.long)
    start = torch.tensor([4, 4])  # 6 answer tokens: positions 4..9
    with torch.no_grad():
        hidden = mean.model(input_ids=ids, attention_mask=mask).last_hidden_state
        a = mean.likelihood(hidden, ids, mask, start)[:, -1]
        b = total.likelihood(hidden, ids, mask, start)[:, -1]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    mean.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert float(load_reward_model(str(tmp_path), tok, likelihood_scale=3.0).likelihood.scale) == 6.0
    with pytest.raises(ConfigError, match="--likelihood_scale are for --likelihood_term"):
        parse_args(RewardArgs, ["--likelihood_scale", "45"])
    with pytest.raises(ConfigError, match="--likelihood_scale must be > 0"):
        parse_args(RewardArgs, ["--likelihood_term", "--likelihood_scale", "0"])
    args = parse_args(RewardArgs, ["--likelihood_term", "--likelihood_norm", "mean", "--likelihood_scale", "45"])[0]
    assert (args.likelihood_norm, args.likelihood_scale) == ("mean", 45.0)
