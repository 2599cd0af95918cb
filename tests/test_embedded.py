"""Project tokenizer, word-start table, tiny models and the cached embedded build (all offline, small)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from marlhf import embedded
from marlhf.embedded.model import TINY_SIZES, create_tiny_model, tiny_config
from marlhf.embedded.task import SyntheticConfig, generate, read_jsonl
from marlhf.embedded.tokenizer import END_OF_CONVERSATION, train_tokenizer
from marlhf.rlhf.termination.word import word_start_table


@pytest.fixture(scope="module")
def records():
    return generate(SyntheticConfig(seed=21, num_records=300))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, records):
    out = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(
        [t for r in records for t in (r.prompt, r.chosen, r.rejected)], out, vocab_size=2000, seed=3
    )
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    return AutoTokenizer.from_pretrained(tok_dir)


# ------------------------------------------------------------------------------------------------ tokenizer
def test_reload_is_fast_and_encodes_identically(tok, tok_dir, records, tmp_path):
    assert tok.is_fast
    text = records[0].prompt + records[0].chosen
    again = train_tokenizer([t for r in records for t in (r.prompt, r.chosen, r.rejected)], tmp_path, 2000, 3)
    assert again(text)["input_ids"] == tok(text)["input_ids"]  # training is deterministic
    assert (tmp_path / "tokenizer.json").read_text() == (tok_dir / "tokenizer.json").read_text()


def test_round_trip_of_task_text_including_newlines(tok, records):
    extra = "Héllo  wörld\ttab 😀\n\nend <|endoftext|> tail"
    for text in [t for r in records[:50] for t in (r.prompt, r.chosen, r.rejected)] + [extra]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        with_bos = tok(text)["input_ids"]
        assert with_bos[0] == tok.bos_token_id and with_bos[1:] == ids
    assert tok.decode(tok("a<|endoftext|>b")["input_ids"], skip_special_tokens=True) == "ab"
    assert tok.convert_ids_to_tokens(tok("a\nb", add_special_tokens=False)["input_ids"]).count("\n") == 1


def test_prompt_and_response_tokenise_the_same_apart_and_together(tok, records):
    """A response starts with a space, so splitting at "TL;DR:" never changes the tokens."""
    for r in records[:50]:
        for response in (r.chosen, r.rejected):
            apart = tok(r.prompt)["input_ids"] + tok(response, add_special_tokens=False)["input_ids"]
            assert apart == tok(r.prompt + response)["input_ids"]


def test_special_tokens(tok):
    specials = {"pad": tok.pad_token, "bos": tok.bos_token, "eos": tok.eos_token, "unk": tok.unk_token}
    assert specials == {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>"}
    ids = [tok.convert_tokens_to_ids(t) for t in [*specials.values(), END_OF_CONVERSATION]]
    assert ids == [0, 2, 3, 1, 4] and len(set(ids)) == 5
    eoc = tok(" answer" + END_OF_CONVERSATION, add_special_tokens=False)["input_ids"]
    assert eoc[-1] == 4 and eoc.count(4) == 1  # one token, never split
    assert END_OF_CONVERSATION in tok.all_special_tokens


def test_offsets_mapping_points_back_into_the_text(tok, records):
    text = records[1].prompt + records[1].chosen
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    tokens = tok.convert_ids_to_tokens(enc["input_ids"])
    assert enc["offset_mapping"][0][0] == 0 and enc["offset_mapping"][-1][1] == len(text)
    previous_end = 0
    for (start, end), piece in zip(enc["offset_mapping"], tokens):
        assert start == previous_end  # contiguous: every character belongs to exactly one token
        assert text[start:end] == piece.replace("▁", " ")
        previous_end = end


def test_word_start_table_on_a_sentence(tok):
    text = " My roommate (26M) got a cat.\nShould I move out?"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    table = word_start_table(tok)
    assert table.dtype == torch.bool and table.shape == (len(tok),)
    flags = table[torch.tensor(ids)].tolist()
    # Group tokens into words by the flags; decoded groups are exactly the whitespace-led words.
    groups, current = [], []
    for i, flag in zip(ids, flags):
        if flag and current:
            groups.append(current)
            current = []
        current.append(i)
    groups.append(current)
    words = [tok.decode(g) for g in groups]
    assert words == [" My", " roommate", " (26M)", " got", " a", " cat.", "\nShould", " I", " move", " out?"]
    specials = [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, 4]
    assert table[specials].all()
    assert word_start_table(tok, size=len(tok) + 3)[-3:].all()  # padded embedding rows
    with pytest.raises(ValueError, match="size"):
        word_start_table(tok, size=10)


def test_word_start_table_for_gpt2_style_byte_level_tokenizer():
    from tokenizers import ByteLevelBPETokenizer

    bl = ByteLevelBPETokenizer()
    bl.train_from_iterator(
        ["My roommate got a cat.\nShould I move out?"] * 20,
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bl._tokenizer, eos_token="<|endoftext|>")
    table = word_start_table(tok)
    vocab = tok.get_vocab()
    assert table[vocab["Ġroommate"]] and table[vocab["Ċ"]] and table[vocab["<|endoftext|>"]]
    assert not table[vocab["My"]] and not table[vocab["."]]
    ids = tok("My cat.\nShould I")["input_ids"]
    assert table[torch.tensor(ids)].tolist() == [
        t.startswith(("Ġ", "Ċ")) for t in tok.convert_ids_to_tokens(ids)
    ]


# ------------------------------------------------------------------------------------------------ tiny models
def test_tiny_model_saves_reloads_with_identical_logits(tok, tmp_path):
    path = create_tiny_model("tiny", tok, tmp_path / "tiny", seed=5)
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= set(
        os.listdir(path)
    )
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.config.model_type == "llama" and model.config.vocab_size == len(tok)
    assert (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id) == (0, 2, 3)
    assert model.generation_config.eos_token_id == [3, 4]  # EOS or end-of-conversation stops generation
    n_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 < n_params < 10_000_000
    ids = tok(["SUBREDDIT: r/pets\nPOST: I (24F) live"], return_tensors="pt")
    again = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        assert torch.equal(model(**ids).logits, again(**ids).logits)
    assert AutoTokenizer.from_pretrained(path)("a b")["input_ids"] == tok("a b")["input_ids"]
    # The seed fixes the weights (and leaves the caller's RNG alone).
    state = torch.random.get_rng_state()
    same = create_tiny_model("tiny", tok, tmp_path / "same", seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)
    other = create_tiny_model("tiny", tok, tmp_path / "other", seed=6)
    w = lambda p: AutoModelForCausalLM.from_pretrained(p).model.embed_tokens.weight  # noqa: E731
    assert torch.equal(w(same), w(path)) and not torch.equal(w(other), w(path))


@pytest.mark.parametrize("size", ["nano", "tiny-gemma", "tiny-gpt2", "small"])
def test_other_sizes(tok, tmp_path, size):
    path = create_tiny_model(size, tok, tmp_path / size, seed=1)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.config.model_type == TINY_SIZES[size]["model_type"]
    n_params = sum(p.numel() for p in model.parameters())
    low, high = {"nano": (0, 1_000_000), "small": (10_000_000, 20_000_000)}.get(size, (1_000_000, 10_000_000))
    assert low < n_params < high
    ids = tok(["POST: I"], return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    n = ids["input_ids"].shape[1]
    assert torch.equal(out[:, :n], ids["input_ids"]) and n < out.shape[1] <= n + 4
    with torch.no_grad():
        again = AutoModelForCausalLM.from_pretrained(path).eval()
        assert torch.equal(model(**ids).logits, again(**ids).logits)


def test_unknown_size_lists_valid_ones(tok):
    with pytest.raises(
        ValueError, match="unknown tiny model size 'huge'; valid sizes: nano, tiny, tiny-gemma"
    ):
        tiny_config("huge", tok)


# ------------------------------------------------------------------------------------------------ embedded
SMALL = dict(seed=9, size="nano", num_records=120, vocab_size=600)


def test_prepare_builds_once_and_is_idempotent(tmp_path):
    paths = embedded.prepare(root=tmp_path, **SMALL)
    assert paths.root.parent == tmp_path and "seed9" in paths.root.name and "n120" in paths.root.name
    recs = read_jsonl(paths.data_file)
    assert recs == generate(SyntheticConfig(seed=9, num_records=120))
    assert AutoTokenizer.from_pretrained(paths.tokenizer_dir).is_fast
    AutoModelForCausalLM.from_pretrained(paths.model_dir)
    manifest = json.loads((paths.root / "manifest.json").read_text())
    assert manifest["statistics"]["num_records"] == 120 and 0 <= manifest["statistics"]["flip_rate"] < 0.3
    watched = [paths.data_file, paths.tokenizer_dir / "tokenizer.json", paths.model_dir / "model.safetensors"]
    mtimes = [p.stat().st_mtime_ns for p in watched]
    again = embedded.prepare(root=tmp_path, **SMALL)
    assert again == paths
    assert [p.stat().st_mtime_ns for p in watched] == mtimes
    assert not [p for p in tmp_path.rglob(".tmp-*")]
    # Another size shares the task folder (same data and tokenizer), gets its own model folder.
    other = embedded.prepare(root=tmp_path, **{**SMALL, "size": "tiny-gemma"})
    assert other.data_file == paths.data_file and other.model_dir != paths.model_dir
    assert paths.data_file.stat().st_mtime_ns == mtimes[0]
    (paths.model_dir / "model.safetensors").rename(tmp_path / "moved")  # damaged by hand: said, not hidden
    with pytest.raises(FileNotFoundError, match="lacks model.safetensors; rebuild it with --force"):
        embedded.prepare(root=tmp_path, **SMALL)
    # Different settings never collide.
    assert embedded.prepare(root=tmp_path, **{**SMALL, "num_records": 100}).root != paths.root


def test_force_rebuilds_identically(tmp_path):
    paths = embedded.prepare(root=tmp_path, **SMALL)
    before = {p: p.read_bytes() for p in [paths.data_file, paths.tokenizer_dir / "tokenizer.json"]}
    model_before = (paths.model_dir / "model.safetensors").read_bytes()
    time_before = paths.data_file.stat().st_mtime_ns
    assert embedded.prepare(root=tmp_path, force=True, **SMALL) == paths
    assert paths.data_file.stat().st_mtime_ns != time_before
    assert {p: p.read_bytes() for p in before} == before  # the build is a pure function of the settings
    assert (paths.model_dir / "model.safetensors").read_bytes() == model_before


def test_crash_leaves_no_partial_build(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(embedded, "create_tiny_model", boom)
    with pytest.raises(RuntimeError, match="simulated crash"):
        embedded.prepare(root=tmp_path, **SMALL)
    task = tmp_path / embedded.task_key(9, 120, 0.1, 600)
    assert task.is_dir() and not (task / "models" / "nano-seed9").exists()  # the task itself completed
    assert not [p for p in tmp_path.rglob(".tmp-*")]
    monkeypatch.undo()
    assert embedded.prepare(root=tmp_path, **SMALL).model_dir.is_dir()


def _build_on_rank(rank: int, root: str) -> dict:
    """Both ranks of a launched run build the same cache at once, and each a tiny model of its own."""
    from pathlib import Path

    paths = embedded.prepare(root=root, **SMALL)
    tok = AutoTokenizer.from_pretrained(paths.tokenizer_dir)
    own = create_tiny_model("nano", tok, Path(root) / f"own-rank{rank}", seed=9)
    return {"shared": sorted(p.name for p in paths.model_dir.iterdir()), "own": sorted(p.name for p in own.iterdir())}


def test_ranks_of_a_launched_run_build_complete_models(tmp_path):
    """Once a process group is up, transformers writes a model's weights on rank 0 only: rank 1's build of the
    cached tiny model used to hold the tokenizer alone, and when its rename won the race the cache was broken for
    every later run ("lacks config.json, model.safetensors").  Every rank now writes what it builds."""
    from rank_harness import run_ranks

    results = run_ranks(_build_on_rank, tmp_path / "ranks", str(tmp_path / "home"), timeout=300)
    for rank, res in enumerate(results):
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(res["shared"]), (rank, res)
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(res["own"]), (rank, res)
    a, b = (AutoModelForCausalLM.from_pretrained(tmp_path / "home" / f"own-rank{r}") for r in (0, 1))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))  # seeded


def test_a_build_missing_a_required_file_keeps_nothing(tmp_path):
    from marlhf.utils.cache import build_atomically

    def half(tmp):
        tmp.mkdir()
        (tmp / "tokenizer.json").write_text("{}")

    with pytest.raises(RuntimeError, match="wrote no config.json, model.safetensors; nothing was kept"):
        build_atomically(tmp_path / "model", half, replace=False,
                         required=("tokenizer.json", "config.json", "model.safetensors"))
    assert not (tmp_path / "model").exists() and not list(tmp_path.iterdir())


def test_default_home_and_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MARLHF_HOME", str(tmp_path / "home"))
    assert embedded.default_home() == tmp_path / "home"
    args = ["--seed", "9", "--size", "nano", "--num_records", "120", "--vocab_size", "600", "--json"]
    assert embedded.main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == embedded.prepare(**SMALL).to_dict()
    assert printed["root"].startswith(str(tmp_path / "home"))
    with pytest.raises(SystemExit):
        embedded.main(["--size", "huge"])
