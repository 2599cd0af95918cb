"""Reward source ``python``: the user's function, ``--reward_function FILE.py:NAME`` or ``package.module:NAME``
(:class:`PythonReward`), called once per scoring call with that rank's rows and checked by
:func:`marlhf.rewards.checks.check_rewards`.

What can be checked before training (a malformed spec, a missing file or module, no such attribute, not
callable, a signature that cannot take the keyword arguments) is a :class:`~marlhf.errors.ConfigError` when the
source is built; a function that raises or returns a malformed answer stops the run with a
:class:`~marlhf.errors.RewardError` naming it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path

from marlhf.errors import ConfigError, RewardError
from marlhf.rewards.checks import check_rewards


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
