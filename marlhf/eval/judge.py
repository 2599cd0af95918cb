"""Pairwise judging of two policies' responses and win rates (paper §4.1 "Evaluation", App. F.1).

One interface, :class:`PairJudge`: given (prompt, first, second) triples in the order they are shown, say
which position wins.  Two implementations:

- :class:`ChatCompletionsJudge` asks a model behind any OpenAI-compatible ``/chat/completions`` endpoint,
  with a task's judge prompt (``marlhf/applications/<task>/judge.txt``), retries with exponential backoff on
  429 / 5xx / timeouts / malformed bodies, at most ``concurrency`` requests in flight, and an on-disk cache
  keyed by everything that determines the answer (so a rerun never pays twice).  The API key is only ever
  put in the Authorization header: never logged, cached, written or shown in a repr.
- :class:`ScorerJudge` compares two scores from any callable scorer (a reward model, a gold scorer).

:func:`compare_policies` randomises the order of each pair with a seed (the paper follows Zheng et al.
2024 in shuffling positions to avoid position bias), records it, undoes it, and :func:`summarize` turns
the outcomes into win / tie / loss rates with 95% Wilson intervals.  Unparseable verdicts and failed
requests are counted in the summary, never dropped silently.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from marlhf.tasks import VerdictFormat, render_template  # a task declares its judge's template and verdicts

logger = logging.getLogger(__name__)

FIRST, SECOND, TIE = "first", "second", "tie"  # positions as shown to the judge
A_WINS, B_WINS = "A", "B"  # policies after undoing the order
UNPARSEABLE, ERROR = "unparseable", "error"


class JudgeError(RuntimeError):
    """A judge could not be used at all (bad URL, rejected key, ...): not a per-pair outcome."""


@dataclasses.dataclass(frozen=True)
class Judgement:
    """What a judge said about one shown pair: ``position`` is FIRST / SECOND / TIE, or None when the
    answer could not be parsed (``raw`` keeps it) or the request failed (``error`` says why)."""

    position: str | None
    raw: str = ""
    error: str = ""
    cached: bool = False


class PairJudge(Protocol):
    def judge_pairs(self, pairs: Sequence[tuple[str, str, str]]) -> list[Judgement]:
        """One :class:`Judgement` per (prompt, first shown, second shown) triple, in order."""
        ...


_JSON_OBJECT = re.compile(r"\{.*\}", re.S)
# Keywords match in any case; the letter itself must be upper case ("is a bit long" is not a verdict).
_LABELLED = re.compile(
    r"(?i:choice|answer|verdict|winner|judgment|judgement|preferred|prefer|better)\s*(?i:is|:|=|-)?\s*"
    r"(?i:summary|response|answer|option)?\s*[\"'*(\[]*\s*([A-Z]|[Tt]ie|TIE)\b")
_X_IS_BETTER = re.compile(
    r"\b(?i:summary|response|answer|option)\s+([A-Z])\s+(?i:is\s+(?:better|more|preferred|superior))")
_TIE_WORDS = re.compile(r"\b(tie|equally good|equally bad|equal quality|both (?:are )?equally)\b", re.I)


def parse_verdict(text: str, fmt: VerdictFormat = VerdictFormat()) -> str | None:
    """FIRST / SECOND / TIE from a judge's answer, or None if it says none of them clearly.

    Accepted forms, tried in order: a bare letter ("A", "**B**.", "'E'"); a JSON object (also inside a
    ```json fence or prose) with ``fmt.json_key`` (or "choice"/"winner"/"verdict"/"overall"); a labelled
    choice in prose ("Choice: A", "my verdict is Response B"), the last one winning; "Response A is better";
    a line holding only a letter, the last such line winning; the word "tie" / "equally good".
    """
    letters = {fmt.first.upper(): FIRST, fmt.second.upper(): SECOND, fmt.tie.upper(): TIE, "TIE": TIE}

    def letter(value) -> str | None:
        if not isinstance(value, str):
            return None
        token = value.strip().strip("*\"'`.()[]:! ").upper()
        token = re.sub(r"^(SUMMARY|RESPONSE|ANSWER|OPTION)\s+", "", token)
        return letters.get(token)

    text = text.strip()
    if (found := letter(text)) is not None:
        return found
    match = _JSON_OBJECT.search(text)
    if match:
        try:
            obj = json.loads(match.group(0))
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            keyed = {str(k).strip().lower(): v for k, v in obj.items()}
            for key in (fmt.json_key.lower(), "choice", "winner", "verdict", "overall"):
                if key in keyed and (found := letter(keyed[key])) is not None:
                    return found
    labelled = [letter(m.group(1)) for m in _LABELLED.finditer(text)]
    labelled = [x for x in labelled if x is not None]
    if labelled:
        return labelled[-1]
    better = [letter(m.group(1)) for m in _X_IS_BETTER.finditer(text)]
    better = [x for x in better if x is not None]
    if better:
        return better[-1]
    for line in reversed(text.splitlines()):
        if (found := letter(line)) is not None:
            return found
    if _TIE_WORDS.search(text):
        return TIE
    return None


# -------------------------------------------------------------------------------------- the remote judge
class ChatCompletionsJudge:
    """A model behind an OpenAI-compatible chat-completions endpoint as a :class:`PairJudge`."""

    def __init__(self, base_url: str, model: str, template: str, api_key: str | None = None,
                 verdict_format: VerdictFormat = VerdictFormat(), cache_dir: str | Path | None = None,
                 concurrency: int = 4, max_retries: int = 5, backoff_s: float = 1.0, max_backoff_s: float = 60.0,
                 timeout_s: float = 60.0, temperature: float = 0.0, max_tokens: int = 256):
        if concurrency < 1 or max_retries < 0:
            raise ValueError(f"need concurrency >= 1 and max_retries >= 0, got {concurrency}, {max_retries}")
        render_template(template, "", "", "")  # fail now on a template without its placeholders
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.template, self.verdict_format = model, template, verdict_format
        self._api_key = api_key  # private: only ever sent in the Authorization header
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.concurrency, self.max_retries = concurrency, max_retries
        self.backoff_s, self.max_backoff_s, self.timeout_s = backoff_s, max_backoff_s, timeout_s
        self.temperature, self.max_tokens = temperature, max_tokens
        self.requests_sent = 0

    def __repr__(self) -> str:
        return f"ChatCompletionsJudge(url={self.url!r}, model={self.model!r}, key={'set' if self._api_key else 'none'})"

    # the cache key: everything that determines the answer, never the API key
    def _cache_path(self, body: dict) -> Path | None:
        if self.cache_dir is None:
            return None
        digest = hashlib.sha256(json.dumps([self.url, body], sort_keys=True).encode()).hexdigest()
        return self.cache_dir / digest[:2] / f"{digest}.json"

    def _post(self, body: dict) -> str:
        """The answer text; retries transient failures; raises JudgeError on a permanent one and
        TimeoutError/ConnectionError-like OSError after the last retry."""
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = "Bearer " + self._api_key
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
                time.sleep(delay * (1 + 0.25 * random.random()))  # jitter: parallel retries spread out
            self.requests_sent += 1
            request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    payload = response.read()
            except urllib.error.HTTPError as err:
                if err.code == 429 or err.code >= 500:
                    last = f"HTTP {err.code}"
                    retry_after = err.headers.get("Retry-After") if err.headers else None
                    if retry_after and retry_after.replace(".", "", 1).isdigit():
                        time.sleep(min(self.max_backoff_s, float(retry_after)))
                    logger.info("judge: %s from %s (attempt %d/%d)", last, self.url, attempt + 1, self.max_retries + 1)
                    continue
                raise JudgeError(f"judge endpoint {self.url} refused the request: HTTP {err.code} {err.reason}"
                                 ) from None
            except (TimeoutError, urllib.error.URLError, ConnectionError) as err:
                reason = getattr(err, "reason", err)
                last = f"{type(err).__name__}: {reason}"
                logger.info("judge: %s from %s (attempt %d/%d)", last, self.url, attempt + 1, self.max_retries + 1)
                continue
            try:
                return json.loads(payload)["choices"][0]["message"]["content"] or ""
            except (json.JSONDecodeError, KeyError, IndexError, TypeError, UnicodeDecodeError):
                last = "malformed response body"
                logger.info("judge: %s from %s (attempt %d/%d)", last, self.url, attempt + 1, self.max_retries + 1)
        raise OSError(f"gave up after {self.max_retries + 1} attempts: {last}")

    def judge_one(self, prompt: str, first: str, second: str) -> Judgement:
        content = render_template(self.template, prompt, first, second)
        body = {"model": self.model, "messages": [{"role": "user", "content": content}],
                "temperature": self.temperature, "max_tokens": self.max_tokens}
        path = self._cache_path(body)
        if path is not None and path.is_file():
            raw = json.loads(path.read_text(encoding="utf-8"))["answer"]
            return Judgement(parse_verdict(raw, self.verdict_format), raw, cached=True)
        try:
            raw = self._post(body)
        except OSError as err:
            return Judgement(None, error=str(err))  # not cached: a rerun tries again
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"model": self.model, "answer": raw}), encoding="utf-8")
            os.replace(tmp, path)  # atomic: a killed run never leaves half an entry
        return Judgement(parse_verdict(raw, self.verdict_format), raw)

    def judge_pairs(self, pairs: Sequence[tuple[str, str, str]]) -> list[Judgement]:
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(lambda p: self.judge_one(*p), pairs))


# --------------------------------------------------------------------------------------- a local judge
class ScorerJudge:
    """A scorer as a :class:`PairJudge`: the higher-scored response wins; |difference| <= ``tie_margin``
    is a tie.  ``score(prompts, responses) -> scores`` is e.g. a reward model or the gold scorer."""

    def __init__(self, score: Callable[[list[str], list[str]], Sequence[float]], tie_margin: float = 0.0):
        self.score, self.tie_margin = score, tie_margin

    def judge_pairs(self, pairs: Sequence[tuple[str, str, str]]) -> list[Judgement]:
        prompts = [p for p, _, _ in pairs]
        firsts = list(self.score(prompts, [f for _, f, _ in pairs]))
        seconds = list(self.score(prompts, [s for _, _, s in pairs]))
        if len(firsts) != len(pairs) or len(seconds) != len(pairs):
            raise ValueError(f"scorer returned {len(firsts)}/{len(seconds)} scores for {len(pairs)} pairs")
        out = []
        for a, b in zip(firsts, seconds):
            position = TIE if abs(a - b) <= self.tie_margin else (FIRST if a > b else SECOND)
            out.append(Judgement(position, raw=f"{a:.6g} vs {b:.6g}"))
        return out


# ------------------------------------------------------------------------------------ comparing policies
@dataclasses.dataclass(frozen=True)
class PairOutcome:
    index: int
    swapped: bool  # True: policy B's response was shown first
    outcome: str  # A_WINS / B_WINS / TIE / UNPARSEABLE / ERROR
    raw: str
    error: str
    cached: bool

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def presentation_order(seed: int, index: int) -> bool:
    """Whether pair ``index`` is shown swapped (B first): a coin flip fixed by (seed, index) alone, so it
    does not depend on which other pairs are judged or in what order."""
    return random.Random(f"{seed}:{index}").random() < 0.5


def compare_policies(judge: PairJudge, prompts: Sequence[str], responses_a: Sequence[str],
                     responses_b: Sequence[str], seed: int = 0) -> list[PairOutcome]:
    """Judge A vs B on each prompt with the order randomised, recorded and undone."""
    if not len(prompts) == len(responses_a) == len(responses_b):
        raise ValueError(f"{len(prompts)} prompts but {len(responses_a)} responses of A and {len(responses_b)} of B")
    swaps = [presentation_order(seed, i) for i in range(len(prompts))]
    shown = [(p, b, a) if s else (p, a, b) for p, a, b, s in zip(prompts, responses_a, responses_b, swaps)]
    judgements = judge.judge_pairs(shown)
    outcomes = []
    for i, (j, swapped) in enumerate(zip(judgements, swaps)):
        if j.error:
            outcome = ERROR
        elif j.position is None:
            outcome = UNPARSEABLE
        elif j.position == TIE:
            outcome = TIE
        else:
            outcome = A_WINS if (j.position == FIRST) != swapped else B_WINS
        outcomes.append(PairOutcome(i, swapped, outcome, j.raw, j.error, j.cached))
    return outcomes


def wilson_interval(successes: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """95% Wilson score interval of a proportion (well-behaved at 0, 1 and small n)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def summarize(outcomes: Sequence[PairOutcome]) -> dict:
    """Counts of every outcome, and win / tie / loss rates of A over the judged pairs (those with a
    verdict) with 95% Wilson intervals.  Unparseable and failed pairs are reported, not hidden."""
    counts = {k: sum(o.outcome == k for o in outcomes) for k in (A_WINS, B_WINS, TIE, UNPARSEABLE, ERROR)}
    judged = counts[A_WINS] + counts[B_WINS] + counts[TIE]
    summary = {"pairs": len(outcomes), "judged": judged, "unparseable": counts[UNPARSEABLE],
               "errors": counts[ERROR], "cached": sum(o.cached for o in outcomes),
               "a_first_shown": sum(not o.swapped for o in outcomes)}
    for name, k in (("win", A_WINS), ("tie", TIE), ("loss", B_WINS)):
        summary[name] = counts[k]
        summary[f"{name}_rate"] = counts[k] / judged if judged else float("nan")
        summary[f"{name}_ci95"] = list(wilson_interval(counts[k], judged))
    return summary
