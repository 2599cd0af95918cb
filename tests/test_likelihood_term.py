"""The reward model's likelihood term (step 2 --likelihood_term): α · Σ log p(answer token) under a next-token
head, added to the score head's value — checked against a loop over unpadded causal-LM forwards, in both
layouts the code meets (right-padded pairs in step 2, left-padded prompts in step 3), and through export."""

import pytest
import torch

from marlhf import embedded
from marlhf.data.pipeline import _pad
from marlhf.models.forward import sequence_scores, token_values
from marlhf.models.loading import load_reward_model, load_tokenizer, load_value_model

EOT = "<|endoftext|>"
TEXTS = [("TL;DR: My cat (3F) bites me.", " I (25M) have a cat that bites."),
         ("TL;DR: We moved to a new city and I miss my friends a lot.", " I miss my friends."),
         ("TL;DR: a", " b c d e f g")]


@pytest.fixture(scope="module")
def nano():
    folder = str(embedded.prepare(size="nano").model_dir)
    tok = load_tokenizer(folder, EOT)
    model = load_reward_model(folder, tok, likelihood_term=True).eval()
    with torch.no_grad():
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=torch.Generator().manual_seed(0)))
        model.likelihood.scale.fill_(0.7)
    return folder, tok, model


def encoded(tok):
    """(prompt ids, answer ids + end token) of each text."""
    return [(tok(p, add_special_tokens=False)["input_ids"], tok(a + EOT, add_special_tokens=False)["input_ids"])
            for p, a in TEXTS]


def loop_reference(folder, tok, model, pairs):
    """Score head at the last token (a plain value model with the same head) + 0.7 · Σ log p(answer token),
    each log p from an unpadded causal-LM forward over the tokens before it."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(folder).eval()
    plain = load_value_model(folder, tok).eval()
    plain.score.load_state_dict(model.score.state_dict())
    out = []
    for prompt, answer in pairs:
        ids = prompt + answer
        with torch.no_grad():
            head = plain(input_ids=torch.tensor([ids])).logits[0, 0].double().item()
            logp = sum(lm(input_ids=torch.tensor([ids[:t]])).logits[0, -1].double().log_softmax(-1)[ids[t]].item()
                       for t in range(len(prompt), len(ids)))
        out.append(head + 0.7 * logp)
    return out


def test_score_is_head_plus_scaled_answer_log_probability_in_both_layouts(nano):
    folder, tok, model = nano
    pairs = encoded(tok)
    expected = loop_reference(folder, tok, model, pairs)
    # step 2's layout: whole sequences right-padded, each row's answer start given
    ids, mask = _pad([p + a for p, a in pairs], tok.pad_token_id)
    start = torch.tensor([len(p) for p, _ in pairs])
    with torch.no_grad():
        right = sequence_scores(model, ids, mask, start)
    assert right.tolist() == pytest.approx(expected, abs=1e-3)
    # step 3's layout: prompts left-padded to one width, answers right-padded after it
    p_ids, p_mask = _pad([p for p, _ in pairs], tok.pad_token_id, left=True)
    a_ids, a_mask = _pad([a for _, a in pairs], tok.pad_token_id)
    with torch.no_grad():
        left = sequence_scores(model, torch.cat([p_ids, a_ids], 1), torch.cat([p_mask, a_mask], 1), p_ids.shape[1])
    assert left.tolist() == pytest.approx(expected, abs=1e-3)
    # the per-token rewards: the term is 0 up to the last prompt token and grows by log p (< 0) per answer token
    with torch.no_grad():
        values = token_values(model, ids, mask, start)
        plain = model.score(model.model(input_ids=ids, attention_mask=mask).last_hidden_state).squeeze(-1)
    term = values - plain
    for row, (p, a) in enumerate(pairs):
        assert term[row, :len(p)].abs().max() < 1e-5
        assert (term[row, len(p):len(p) + len(a)].diff() < 0).all()
    # prompts alone (the answer would start past the last column, even well past it): no term, same shape
    with torch.no_grad():
        alone = token_values(model, p_ids, p_mask, p_ids.shape[1] + 3)
        head = model.score(model.model(input_ids=p_ids, attention_mask=p_mask,
                                       position_ids=(p_mask.cumsum(1) - 1).clamp(min=0)).last_hidden_state)
    assert alone.shape == p_ids.shape and torch.allclose(alone, head.squeeze(-1), atol=1e-5)


def test_term_starts_as_the_folders_lm_head(nano, tmp_path):
    """From a causal LM, the term's head is the LM head (here the input embeddings: nano ties them) and α is
    1: the untrained reward model adds exactly the SFT model's log-likelihood of the answer.  A model with its
    own LM head gives that head."""
    from safetensors.torch import load_file, save_file

    folder, tok, _ = nano
    fresh = load_reward_model(folder, tok, likelihood_term=True)
    weights = load_file(f"{folder}/model.safetensors")
    assert "lm_head.weight" not in weights and fresh.config.tie_word_embeddings
    embed = weights["model.embed_tokens.weight"]
    assert torch.equal(fresh.likelihood.lm_head.weight[:embed.shape[0]], embed)
    assert fresh.likelihood.scale.item() == 1.0 and fresh.config.likelihood_term is True
    # untied: the folder's own lm_head.weight
    import shutil

    untied = tmp_path / "untied"
    shutil.copytree(folder, untied)
    head = torch.randn(embed.shape, generator=torch.Generator().manual_seed(3))
    save_file({**weights, "lm_head.weight": head}, str(untied / "model.safetensors"))
    (untied / "config.json").write_text((untied / "config.json").read_text().replace(
        '"tie_word_embeddings": true', '"tie_word_embeddings": false'))
    own = load_reward_model(str(untied), tok, likelihood_term=True)
    assert not own.config.tie_word_embeddings
    assert torch.equal(own.likelihood.lm_head.weight[:head.shape[0]], head)
    # untied and no lm_head.weight: nothing to start from
    save_file(weights, str(untied / "model.safetensors"))
    with pytest.raises(ValueError, match="no lm_head.weight to start the likelihood term from"):
        load_reward_model(str(untied), tok, likelihood_term=True)


def test_scores_without_the_answer_start_are_refused(nano):
    _, tok, model = nano
    ids, mask = _pad([p + a for p, a in encoded(tok)], tok.pad_token_id)
    with pytest.raises(ValueError, match="likelihood term"):
        sequence_scores(model, ids, mask)


def test_export_keeps_the_term_and_plain_transformers_loads_the_head(nano, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from marlhf.models.export import export_hf

    folder, tok, model = nano
    export_hf(model, tok, tmp_path / "rm")
    back = load_reward_model(str(tmp_path / "rm"), tok).eval()
    ids, mask = _pad([p + a for p, a in encoded(tok)], tok.pad_token_id)
    start = torch.tensor([len(p) for p, _ in encoded(tok)])
    with torch.no_grad():
        assert torch.equal(sequence_scores(back, ids, mask, start), sequence_scores(model, ids, mask, start))
        assert back.likelihood.scale.item() == pytest.approx(0.7)
        # plain transformers reads the score head only (the term's weights are extra keys)
        hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
        plain = model.score(model.model(input_ids=ids, attention_mask=mask).last_hidden_state).squeeze(-1)
        last = mask.sum(1) - 1
        assert torch.allclose(hf(input_ids=ids, attention_mask=mask).logits[:, 0], plain[torch.arange(3), last],
                              atol=1e-5)


def test_the_term_loads_from_sharded_weights(nano, tmp_path):
    """A large reward model is saved in shards with an index: the term's weights are found through it."""
    folder, tok, model = nano
    model.save_pretrained(tmp_path / "rm", max_shard_size="200KB")
    tok.save_pretrained(tmp_path / "rm")
    assert (tmp_path / "rm" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "rm").glob("model-*.safetensors"))) > 1
    back = load_reward_model(str(tmp_path / "rm"), tok).eval()
    assert torch.equal(back.likelihood.lm_head.weight, model.likelihood.lm_head.weight)
    assert back.likelihood.scale.item() == pytest.approx(0.7)


def test_loading_the_term_reports_no_unexpected_keys_and_leaves_transformers_as_it_was(nano, tmp_path):
    """transformers' load report would list the term's weights as UNEXPECTED on every load of such a reward
    model; ours loads them itself and says nothing, while plain transformers still reports them."""
    import logging

    import transformers
    from transformers import AutoModelForSequenceClassification

    from marlhf.models.export import export_hf

    folder, tok, model = nano
    export_hf(model, tok, tmp_path / "rm")
    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    keep, logger, level = Keep(), logging.getLogger("transformers"), transformers.logging.get_verbosity()
    logger.addHandler(keep)
    transformers.logging.set_verbosity_warning()
    try:
        load_reward_model(str(tmp_path / "rm"), tok)
        ours = list(messages)
        AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
        theirs = messages[len(ours):]
    finally:
        logger.removeHandler(keep)
        transformers.logging.set_verbosity(level)
    assert not any("likelihood" in m for m in ours), ours
    assert any("likelihood.lm_head.weight" in m and "UNEXPECTED" in m for m in theirs), theirs


def test_a_folder_claiming_a_term_without_its_weights_is_named(nano, tmp_path):
    folder, tok, _ = nano
    plain = load_value_model(folder, tok)
    plain.config.likelihood_term = True
    plain.save_pretrained(tmp_path / "rm")
    with pytest.raises(ValueError, match=r"rm: its weights lack likelihood\.lm_head\.weight"):
        load_reward_model(str(tmp_path / "rm"), tok)


def test_flattened_rewards_are_counted_and_warned_once(monkeypatch, caplog):
    """Step 3 logs the share of scores outside ±--clip_reward_value (train/clipped_scores) and warns once when
    most are: raw scores of a reward model with the term sit near -8, where DeepSpeed-Chat's ±5 flattens them."""
    from marlhf.rlhf import rollout

    scores = torch.tensor([-8.0, -6.0, -4.0, 7.0, 5.0])
    assert rollout.clipped_share(scores, 5.0) == pytest.approx(0.6)
    assert rollout.clipped_share(scores, 100.0) == 0.0 and rollout.clipped_share(scores, None) == 0.0
    monkeypatch.setattr(rollout, "_warned_clip", False)
    rollout._warn_if_flattened(0.4, 5.0)  # a minority: no warning
    rollout._warn_if_flattened(0.6, 5.0)
    rollout._warn_if_flattened(0.9, 5.0)  # once per run
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "60% of a batch's scores lie outside ±5" in warnings[0]
