"""Reward source ``remote``: the user's HTTP server, ``--reward_url URL`` (:class:`RemoteReward`): POST
{"prompts", "responses", "meta", "ended"} as JSON, read {"rewards": [...]} (OpenRLHF's remote reward model shape),
once per scoring call with that rank's rows.

A URL that is not http(s) is a :class:`~marlhf.errors.ConfigError` when the source is built; a server that
cannot be reached after the retries or answers 4xx, a malformed answer, a wrong count, a non-number, nan / inf
stop the run with a :class:`~marlhf.errors.RewardError` naming the URL.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import time
import urllib.error
import urllib.parse
import urllib.request

from marlhf.errors import ConfigError, RewardError
from marlhf.rewards.checks import check_rewards, short

log = logging.getLogger("marlhf")

RETRY_BACKOFF_S = 1.0  # the wait before the first retry; it doubles before each further one

def check_url(url: str) -> None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"--reward_url {url!r}: expected an http:// or https:// URL with a host "
                          f"(e.g. http://127.0.0.1:8000/score)")


class RemoteReward:
    """Reward source ``remote``: one POST per scoring call of

        {"prompts": [str], "responses": [str], "meta": [dict], "ended": [bool] | null}

    (``Content-Type: application/json``; a server written for OpenRLHF's remote reward model reads the
    first two and ignores the rest), answered by ``{"rewards": [number, ...]}``, one per response (other keys
    are ignored).  Each attempt waits at most ``timeout`` seconds for the connection and each read; a
    connection error, a timeout or an HTTP 5xx is retried ``retries`` times, after ``backoff`` seconds, then
    twice that, and so on.  An HTTP 4xx, an answer that is not such JSON, a wrong count or a non-finite
    reward is the user's or the server's bug: a :class:`RewardError` at once, as after the last attempt."""

    def __init__(self, url: str, timeout: float = 60.0, retries: int = 3, backoff: float = RETRY_BACKOFF_S):
        check_url(url)
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ConfigError(f"--reward_timeout must be a positive number of seconds, got {timeout}")
        if retries < 0:
            raise ConfigError(f"--reward_retries must be >= 0, got {retries}")
        self.url, self.timeout, self.retries, self.backoff = url, float(timeout), int(retries), float(backoff)

    def score(self, prompts, responses, meta, *, ended=None) -> list[float]:
        responses = list(responses)
        body = {"prompts": list(prompts), "responses": responses, "meta": list(meta),
                "ended": None if ended is None else [bool(e) for e in ended]}
        try:
            data = json.dumps(body).encode("utf-8")
        except (TypeError, ValueError) as err:  # the records' meta is JSON-able by design; say so if not
            raise RewardError(f"--reward_url {self.url}: the request cannot be sent as JSON ({err}); each "
                              f"record's meta must hold JSON values only") from err
        raw = self._post(data)
        who = f"--reward_url {self.url}"
        try:
            answer = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise RewardError(f"{who}: the answer is not JSON ({err}): {short(raw)}") from err
        if not isinstance(answer, dict) or "rewards" not in answer:
            raise RewardError(f"{who}: expected a JSON object with a 'rewards' list, got {short(answer)}")
        return check_rewards(answer["rewards"], responses, who)

    def _post(self, data: bytes) -> bytes:
        attempts = 1 + self.retries
        last = ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data=data, method="POST",
                                             headers={"Content-Type": "application/json",
                                                      "Accept": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return response.read()
            except urllib.error.HTTPError as err:  # before URLError, its base class
                detail = short(_body_of(err))
                if err.code < 500:  # the request itself is wrong: the same request would fail again
                    raise RewardError(f"--reward_url {self.url}: HTTP {err.code} {err.reason} {detail} (a client "
                                      f"error, not retried)") from err
                last = f"HTTP {err.code} {err.reason} {detail}"
            except (urllib.error.URLError, http.client.HTTPException, OSError) as err:  # refused, reset, timeout
                reason = err.reason if isinstance(err, urllib.error.URLError) else err
                last = f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__
            if attempt + 1 < attempts:
                log.warning("reward server %s: attempt %d of %d failed (%s); retrying in %g s", self.url,
                            attempt + 1, attempts, last, self.backoff * 2 ** attempt)
        raise RewardError(f"--reward_url {self.url}: no answer after {attempts} attempts (1 + --reward_retries "
                          f"{self.retries}, --reward_timeout {self.timeout:g} s each); last error: {last}")


def _body_of(err: urllib.error.HTTPError) -> bytes:
    try:
        return err.read() or b""
    except (OSError, http.client.HTTPException):
        return b""
