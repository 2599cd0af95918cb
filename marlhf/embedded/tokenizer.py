"""The project's own tokenizer for the embedded task, and the per-token "starts a word" table.

:func:`train_tokenizer` trains a SentencePiece BPE model on the task's text and wraps it as a Hugging
Face *fast* tokenizer (``tokenizer.json``), so it loads with ``AutoTokenizer.from_pretrained(folder)``
offline, exactly like a downloaded model's tokenizer, and supports ``return_offsets_mapping=True``.

Choices, and why:
- BPE rather than unigram: on the task's small closed vocabulary (~750 distinct words) SentencePiece's
  unigram trainer stops far below 2000 pieces and splits common words into letters; BPE reaches the
  requested size with whole-word pieces, like a real LM tokenizer on English.
- identity normalisation, no extra-whitespace removal, no dummy prefix, byte fallback: decoding gives
  back the exact text (newlines, the leading space of a response), and a prompt and its response
  tokenise the same way apart as together, because a response starts with a space ("TL;DR:" + " My...").
- newline is its own piece, so the post's line structure costs one token per line.
- a BOS token is prepended (as Llama and Gemma tokenizers do), so pipeline code handles BOS on the
  embedded default as it must for real models.
- ``<|endoftext|>`` is a single special token: DeepSpeed-Chat's ``--end_of_conversation_token`` default.

:func:`word_start_table` serves the ``word`` macro-action rule (docs/design.md "Macro actions, precisely"):
a macro action runs from a word-starting token up to the next one.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterable
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
END_OF_CONVERSATION = "<|endoftext|>"
NEWLINE = "\n"
MODEL_MAX_LENGTH = 1024  # matches the tiny models' max_position_embeddings


def train_tokenizer(
    texts: Iterable[str],
    out_dir: str | Path,
    vocab_size: int = 2000,
    seed: int = 1234,
) -> PreTrainedTokenizerBase:
    """Train a SentencePiece BPE tokenizer on ``texts``, save it to ``out_dir`` and return it reloaded.

    ``vocab_size`` is an upper bound: a corpus too small for it yields a smaller vocabulary (logged).
    Ids: 0 ``<pad>``, 1 ``<unk>``, 2 ``<s>``, 3 ``</s>``, 4 ``<|endoftext|>``, 5 newline, then 256 byte
    pieces and the learned pieces.
    """
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    # SentencePiece trains on sentences without newlines; the newline piece is added as a user symbol.
    lines = [line for text in texts for line in text.split(NEWLINE) if line.strip()]
    if not lines:
        raise ValueError("train_tokenizer: no non-empty text to train on")
    if vocab_size < 300:
        raise ValueError(
            f"train_tokenizer: vocab_size must be >= 300 (256 byte pieces + specials), got {vocab_size}"
        )
    spm.set_random_generator_seed(seed)
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buffer,
        model_type="bpe",
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        character_coverage=1.0,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        pad_piece=PAD,
        unk_piece=UNK,
        bos_piece=BOS,
        eos_piece=EOS,
        control_symbols=[END_OF_CONVERSATION],
        user_defined_symbols=[NEWLINE],
        num_threads=1,  # one thread: bit-reproducible for a seed
        shuffle_input_sentence=False,
        input_sentence_size=0,
        max_sentence_length=1 << 16,
        minloglevel=2,
    )
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(buffer.getvalue())
    if len(proto.pieces) < vocab_size:
        logger.info(
            "tokenizer: corpus supports %d pieces, fewer than the requested %d", len(proto.pieces), vocab_size
        )
    tokenizer = _wrap_sentencepiece(proto)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    logger.info("tokenizer: %d tokens saved to %s", len(tokenizer), out_dir)
    return AutoTokenizer.from_pretrained(out_dir)


def _wrap_sentencepiece(proto) -> PreTrainedTokenizerFast:
    """Build the equivalent ``tokenizers`` BPE pipeline from a SentencePiece BPE ModelProto."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    # SentencePiece BPE stores no merge list: its pieces are ordered by merge time (score = -rank).  A piece
    # is reachable by merging any two pieces that concatenate to it; earlier pieces merge first.
    merges = []
    normal = 1  # ModelProto.SentencePiece.Type.NORMAL
    for piece in proto.pieces:
        if piece.type != normal or len(piece.piece) < 2:
            continue
        text = piece.piece
        splits = [
            (text[:k], text[k:]) for k in range(1, len(text)) if text[:k] in vocab and text[k:] in vocab
        ]
        merges += [(vocab[text], vocab[a], vocab[b], a, b) for a, b in splits]
    merges.sort()
    backend = Tokenizer(
        BPE(
            vocab=vocab,
            merges=[(a, b) for *_, a, b in merges],
            unk_token=UNK,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    backend.normalizer = None
    # split=True: no piece crosses a space, as in SentencePiece's split_by_whitespace.
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    specials = [PAD, UNK, BOS, EOS, END_OF_CONVERSATION]
    # The newline is an added (non-special) token so it is always one token and never merged.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.add_tokens([AddedToken(NEWLINE, special=False, normalized=False)])
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        extra_special_tokens=[END_OF_CONVERSATION],
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
