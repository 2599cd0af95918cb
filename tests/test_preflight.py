"""What cannot be had stops once, clearly (issue 57.7): a model or dataset the hub cannot give, or more GPUs than the
machine has, stop the quick start before any step starts (and a step before its model loads) with one message that
names it and how to pass a local copy.  The network is blocked where the suite runs, the case a new user on a machine
without the hub meets; a name that does not exist fails the same way where the hub can be reached."""

import os
import subprocess
import sys

import huggingface_hub
import pytest
from huggingface_hub import constants as hub_constants

from marlhf import preflight
from marlhf.errors import ConfigError

MISSING = "marlhf-tests/no-such-model-issue-57"


def no_network(monkeypatch):
    """Any metadata request fails the test: what is local must be found without the hub."""
    def refuse(*args, **kwargs):
        pytest.fail("the hub was asked")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", refuse)
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", refuse)


def test_quickstart_stops_once_before_any_rank_on_a_model_it_cannot_have(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(NUM_GPUS="1", MODEL_PATH=MISSING)  # one (CPU) rank asked for explicitly: the model is what fails
    out = subprocess.run([sys.executable, "-m", "marlhf", "quickstart", "--size", "gemma-2b", "--task", "tldr",
                          "--output_dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120,
                         env=env, cwd=tmp_path)
    assert out.returncode == 1
    text = out.stdout + out.stderr
    assert text.count("cannot be had") == 1 and "Traceback" not in text
    assert f"model '{MISSING}' (--model_name_or_path)" in text
    assert "local copy" in text and "MODEL_PATH=DIR" in text and "HF_HUB_OFFLINE=1" in text
    assert "=== step" not in text and not (tmp_path / "run/step1/training.log").exists()  # nothing started


def test_offline_names_the_setting_and_asks_nothing(monkeypatch, tmp_path):
    no_network(monkeypatch)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match=f"model '{MISSING}' .*HF_HUB_OFFLINE is set and it is not in the local"):
        preflight.check_model(MISSING)
    with pytest.raises(ConfigError, match=r"dataset 'openai/summarize_from_feedback' .*'openai/summarize_from_fe"
                                          r"edback:PATH'"):
        preflight.check_data(["synthetic", "openai/summarize_from_feedback"])


def test_local_and_cached_models_need_no_hub(monkeypatch, tmp_path):
    no_network(monkeypatch)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    folder = tmp_path / "my-model"
    folder.mkdir()
    preflight.check_model(str(folder))  # a local folder
    preflight.check_model("")  # the embedded model
    snapshot = tmp_path / "hub" / "models--org--cached" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    preflight.check_model("org/cached")  # in the cache: the libraries read it from there
    preflight.check_data(["synthetic:seed=3", "synthetic_code"])
    with pytest.raises(ConfigError, match="model folder './gone' .* does not exist"):
        preflight.check_model("./gone")  # a path, never a hub name


def test_hub_answers_name_the_reason(monkeypatch, tmp_path):
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    for error, reason in ((GatedRepoError, "it is gated"), (RepositoryNotFoundError, "the hub has no such repository"),
                          (TimeoutError, r"the hub cannot be reached \(TimeoutError")):
        def answer(self, name, timeout=None, error=error):
            assert timeout == preflight.TIMEOUT_S
            raised = error.__new__(error)  # the hub's errors want an HTTP response to build; the type is what counts
            Exception.__init__(raised, "no")
            raise raised

        monkeypatch.setattr(huggingface_hub.HfApi, "model_info", answer)
        with pytest.raises(ConfigError, match=reason):
            preflight.check_model("google/gemma-2b")


@pytest.mark.parametrize(("gpus", "env", "message"), [
    (0, {}, "--size gemma-2b runs on 8 GPUs per node (NUM_GPUS, default 8) and this machine has none"),
    (2, {}, "step 1 asks for NUM_GPUS=8 GPUs and this machine has 2: set NUM_GPUS=2"),
    (0, {"NUM_GPUS": "2"}, None),  # CPU ranks, asked for by name: allowed
])
def test_quickstart_checks_the_gpus_before_starting(gpus, env, message, monkeypatch, tmp_path):
    from marlhf.cli import quickstart

    monkeypatch.setattr(quickstart, "visible_gpus", lambda: gpus)
    monkeypatch.setattr(quickstart, "check_model", lambda *a: None)  # the devices alone here
    monkeypatch.setattr(quickstart, "check_data", lambda *a: None)
    monkeypatch.delenv("NUM_GPUS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = quickstart.parse_args(["--size", "gemma-2b", "--output_dir", str(tmp_path)])
    if message is None:
        plans = quickstart.preflight(args, tmp_path)
        assert [p.num_gpus for p in plans] == [2, 2, 2]
        return
    with pytest.raises(SystemExit) as stop:
        quickstart.preflight(args, tmp_path)
    assert message in str(stop.value)
