"""The user's own reward, behind the :class:`marlhf.rewards.RewardSource` interface:

    python   a function in the user's code, ``--reward_function FILE.py:NAME`` or ``package.module:NAME``
                                                                                   :class:`PythonReward`
    remote   an HTTP server, ``--reward_url URL``: POST {"prompts", "responses", "meta", "ended"} as JSON,
             read {"rewards": [...]} (OpenRLHF's remote reward model shape)         :class:`RemoteReward`

Both are called once per scoring call with that rank's rows only, and return one finite number per response.
What can be checked before training (a malformed spec, a missing file or module, no such attribute, not
callable, a signature that cannot take the keyword arguments, a URL that is not http(s)) is a
:class:`~marlhf.errors.ConfigError` when the source is built; what goes wrong during the run (the function
raises, the server cannot be reached after the retries or answers 4xx, a malformed answer, a wrong count, a
non-number, nan / inf) stops it with a :class:`~marlhf.errors.RewardError` naming the function or URL: a
reward that is silently replaced would train the policy on something the user never wrote.
"""

from __future__ import annotations

import hashlib
import http.client
import importlib
import importlib.util
import inspect
import json
import logging
import math
import numbers
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from marlhf.errors import ConfigError, RewardError

log = logging.getLogger("marlhf")

RETRY_BACKOFF_S = 1.0  # remote: the wait before the first retry; it doubles before each further one


# ---------------------------------------------------------------------------------------------- checks
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
            raise RewardError(f"{who}: reward {i} is {_short(v)} ({type(v).__name__}), not a number "
                              f"(response {i}: {_short(responses[i])})")
        f = float(v)
        if not math.isfinite(f):
            raise RewardError(f"{who}: reward {i} is {f} (response {i}: {_short(responses[i])})")
        out.append(f)
    return out


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ---------------------------------------------------------------------------------------------- python
def split_function_spec(spec: str) -> tuple[str, str, bool]:
    """``FILE.py:NAME`` / ``package.module:NAME`` -> (file or module, NAME, is a file); a ConfigError if
    malformed.  A file is anything ending in ``.py`` or containing a path separator."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where.strip() or not name.isidentifier():
        raise ConfigError(f"--reward_function {spec!r}: expected FILE.py:NAME or package.module:NAME (the "
                          f"function's name after the last ':')")
    return where, name, where.endswith(".py") or "/" in where or os.sep in where


def check_function_spec(spec: str) -> None:
    """What config validation can check without importing the user's code: the form, and that a file exists."""
    where, _, is_file = split_function_spec(spec)
    if is_file and not Path(where).expanduser().is_file():
        raise ConfigError(f"--reward_function {spec}: no such file {Path(where).expanduser().resolve()} (a "
                          f"relative path is read from the working directory {os.getcwd()})")


def load_reward_function(spec: str) -> Callable:
    """Import the function named by ``spec`` (a file path, relative to the working directory, or a module on
    ``sys.path``).  A file is imported on its own, as a module named after its path: its folder is not put
    on ``sys.path`` (a reward spread over several files is a package, given as ``package.module:NAME``)."""
    where, name, is_file = split_function_spec(spec)
    if is_file:
        check_function_spec(spec)
        path = Path(where).expanduser().resolve()
        # one module name per file: loading the same file twice gives the same module object back
        module_name = f"_marlhf_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
        module = sys.modules.get(module_name)
        if module is None:
            mod_spec = importlib.util.spec_from_file_location(module_name, path)
            if mod_spec is None or mod_spec.loader is None:
                raise ConfigError(f"--reward_function {spec}: {path} cannot be imported as a Python module")
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[module_name] = module  # what dataclasses / pickle inside the file look up
            try:
                mod_spec.loader.exec_module(module)
            except Exception as err:
                del sys.modules[module_name]
                raise ConfigError(f"--reward_function {spec}: importing {path} failed: "
                                  f"{type(err).__name__}: {err}") from err
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as err:
            raise ConfigError(f"--reward_function {spec}: no module {where!r} ({err}); give a file ending in .py "
                              f"or a module on PYTHONPATH") from err
        except Exception as err:
            raise ConfigError(f"--reward_function {spec}: importing {where} failed: "
                              f"{type(err).__name__}: {err}") from err
    if not hasattr(module, name):
        raise ConfigError(f"--reward_function {spec}: {where} has no attribute {name!r}")
    fn = getattr(module, name)
    if not callable(fn):
        raise ConfigError(f"--reward_function {spec}: {name} is a {type(fn).__name__}, not a function")
    return fn


def takes_ended(fn: Callable, spec: str) -> bool:
    """Whether ``fn`` gets ``ended=`` too: when it names an ``ended`` parameter or takes ``**kwargs``.  A
    ConfigError if it cannot be called with the keyword arguments prompts, responses and meta."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): called with the three
        return False
    params = sig.parameters
    ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) or (
        "ended" in params and params["ended"].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                       inspect.Parameter.KEYWORD_ONLY))
    try:
        sig.bind(prompts=[], responses=[], meta=[], **({"ended": []} if ended else {}))
    except TypeError as err:
        call = "prompts=..., responses=..., meta=..." + (", ended=..." if ended else "")
        raise ConfigError(f"--reward_function {spec}: cannot be called as {getattr(fn, '__name__', spec)}({call}): "
                          f"{err}") from err
    return ended


class PythonReward:
    """Reward source ``python``: ``fn(prompts=[str], responses=[str], meta=[dict])`` (and ``ended=[bool]``,
    which answers stopped at the end token, when the function takes it) -> one number per response.

    Loaded once, when built; every call gets fresh lists (and shallow copies of the meta dicts), so a
    function that edits its arguments cannot change the dataset's records."""

    def __init__(self, spec: str):
        self.spec = spec
        self.fn = load_reward_function(spec)
        self.takes_ended = takes_ended(self.fn, spec)

    def score(self, prompts, responses, meta, *, ended=None) -> list[float]:
        responses = list(responses)  # ours, to check the count against: the function gets its own copies
        kwargs = {"prompts": list(prompts), "responses": list(responses), "meta": [dict(m) for m in meta]}
        if self.takes_ended:
            kwargs["ended"] = None if ended is None else [bool(e) for e in ended]
        try:
            values = self.fn(**kwargs)
        except Exception as err:
            raise RewardError(f"--reward_function {self.spec} raised {type(err).__name__}: {err}") from err
        return check_rewards(values, responses, f"--reward_function {self.spec}")


# ---------------------------------------------------------------------------------------------- remote
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
            raise RewardError(f"{who}: the answer is not JSON ({err}): {_short(raw)}") from err
        if not isinstance(answer, dict) or "rewards" not in answer:
            raise RewardError(f"{who}: expected a JSON object with a 'rewards' list, got {_short(answer)}")
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
                detail = _short(_body_of(err))
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
