"""scripts/gpu_check.py, the GPU confirmation run: its refusal without a GPU, its commands (each must parse with
the step's own parser, so the script keeps up with the flags), the figures it reads from a run's folder and
its verdicts — the parts that run without a GPU."""
import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_refuses_without_a_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device is visible"):
        gpu_check.main(["--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_every_command_parses_with_its_steps_parser(tmp_path):
    from marlhf.cli import generate
    from marlhf.config import RewardArgs, RLHFArgs, SFTArgs, parse_args
    parsers = {"sft": SFTArgs, "rm": RewardArgs, "ppo": RLHFArgs}
    checks = gpu_check.plan(gpu_check.parse_args(["--out", str(tmp_path), "--steps", "7"]))
    assert [c["name"] for c in checks] == ["sft_bf16_z2", "rm_bf16_z2", "ppo_bf16_z2", "ppo_bf16_z3", "ppo_fp16_z2",
                                           "ppo_offload_ref", "hybrid_refused", "generate_auto", "rm_bf16_z3_accum2",
                                           "ppo_bf16_z3_ranks", "ppo_synced_ranks"]
    seen = {}
    for c in checks:
        step, argv = c["argv"][0], c["argv"][1:]
        if step == "generate":
            args = generate.parse_args(argv)
            assert (args.device, args.dtype) == ("auto", "auto")
            assert args.model == str(tmp_path / "sft_bf16_z2")  # the run's own step 1 without --actor
            continue
        args, _ = parse_args(parsers[step], argv)
        seen[c["name"]] = args
    assert seen["ppo_bf16_z2"].max_steps == 7 and seen["ppo_bf16_z3"].max_steps == 7
    assert (seen["ppo_bf16_z3"].actor_zero_stage, seen["ppo_bf16_z3"].critic_zero_stage) == (3, 3)
    assert seen["ppo_fp16_z2"].dtype == "fp16" and seen["ppo_bf16_z2"].dtype == "bf16"
    assert seen["ppo_offload_ref"].offload_reference_model and not seen["ppo_bf16_z2"].offload_reference_model
    assert seen["hybrid_refused"].enable_hybrid_engine
    assert seen["ppo_bf16_z2"].critic_model_name_or_path == str(tmp_path / "rm_bf16_z2")
    assert (seen["sft_bf16_z2"].zero_stage, seen["sft_bf16_z2"].dtype, seen["rm_bf16_z2"].max_steps) == (2, "bf16", 60)
    # the multi-rank checks: what one process cannot show (ZeRO-3 accumulation, ranks generating in step)
    rm = seen["rm_bf16_z3_accum2"]
    assert (rm.zero_stage, rm.gradient_accumulation_steps) == (3, 2)
    for name, mode in (("ppo_bf16_z3_ranks", "gather"), ("ppo_synced_ranks", "synced")):
        a = seen[name]
        assert (a.actor_zero_stage, a.critic_zero_stage, a.gradient_accumulation_steps) == (3, 3, 2)
        assert a.enable_ema and a.critic_mc_check == 1 and a.zero3_generation == mode


def test_multi_rank_checks_start_the_launcher_beside_python(tmp_path):
    import sys

    checks = {c["name"]: c for c in gpu_check.plan(gpu_check.parse_args(["--out", str(tmp_path), "--ranks", "4"]))}
    cmd = gpu_check.command(checks["ppo_bf16_z3_ranks"])
    assert cmd[:5] == [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "4", "--module", "marlhf.cli.ppo"]
    assert gpu_check.command(checks["ppo_bf16_z2"])[:4] == [sys.executable, "-m", "marlhf", "ppo"]
    one = gpu_check.plan(gpu_check.parse_args(["--out", str(tmp_path), "--ranks", "1"]))
    assert not any(c.get("ranks", 1) > 1 for c in one)


def test_only_and_given_models(tmp_path):
    args = gpu_check.parse_args(["--out", str(tmp_path), "--actor", "A", "--reward", "R", "--only", "ppo_bf16_z3"])
    (check,) = gpu_check.plan(args)
    argv = check["argv"]
    assert argv[argv.index("--actor_model_name_or_path") + 1] == "A"
    assert argv[argv.index("--critic_model_name_or_path") + 1] == "R"
    with pytest.raises(SystemExit, match=r"no check named \['ppo_bf17'\]"):
        gpu_check.plan(gpu_check.parse_args(["--out", str(tmp_path), "--only", "ppo_bf17"]))


def write_run(run_dir: Path, train: list[dict], summary: dict | None = None) -> None:
    run_dir.mkdir(parents=True)
    rows = [{"step": i + 1, **{f"train/{k}": v for k, v in r.items()}} for i, r in enumerate(train)]
    rows.insert(2, {"step": 2, "eval/gold_score": 0.5})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary:
        (run_dir / "summary.json").write_text(json.dumps(summary))


def test_step3_figures_from_a_runs_folder(tmp_path):
    train = [dict(ratio_mean=0.998, approx_kl=1e-4, overflow_steps=1.0, skipped_steps_total=0.0, step_seconds=s,
                  gen_seconds=g, kl=k, critic_loss=c)
             for s, g, k, c in [(3.0, 1.0, 0.0, 9.0), (1.0, 0.5, 0.1, 7.0), (2.0, 0.25, 0.2, 5.0)]]
    train[1]["ratio_mean"] = 0.5  # only the first step's ratio is read
    write_run(tmp_path / "ppo_x", train, {"initial_policy": {"gold_score": 0.6, "gold_score_se": 0.02, "kl": 0.0},
                                          "final_policy": {"gold_score": 0.7, "rm_score": -3.0, "eos_rate": 1.0}})
    got = gpu_check.numbers("ppo_x", tmp_path / "ppo_x")
    assert got["steps"] == 3 and got["ratio_mean_step1"] == 0.998 and got["approx_kl_step1"] == 1e-4
    assert got["overflow_steps"] == 3.0 and got["step_seconds_median"] == 2.0 and got["gen_seconds_median"] == 0.5
    assert (got["last_kl"], got["last_critic_loss"]) == (0.2, 5.0)
    assert (got["initial_gold_score"], got["initial_gold_score_se"], got["final_gold_score"]) == (0.6, 0.02, 0.7)
    assert (got["final_rm_score"], got["final_eos_rate"]) == (-3.0, 1.0) and "final_kl" not in got
    ok, why = gpu_check.judge({"name": "ppo_x", "expect": "ok"}, 0, "", got)
    assert (ok, why) == (True, "ok")
    got["skipped_steps_total"] = 2.0
    assert gpu_check.judge({"name": "ppo_x", "expect": "ok"}, 0, "", got) == (False, "2 non-finite steps skipped")
    del got["final_gold_score"]
    got["skipped_steps_total"] = 0.0
    assert gpu_check.judge({"name": "ppo_x", "expect": "ok"}, 0, "", got) == (False, "no final evaluation")


def test_supervised_verdicts(tmp_path):
    write_run(tmp_path / "sft_bf16_z2", [dict(loss=2.0), dict(loss=1.5), dict(loss=2.5)])
    got = gpu_check.numbers("sft_bf16_z2", tmp_path / "sft_bf16_z2")
    assert (got["steps"], got["first_loss"], got["last_loss"]) == (3, 2.0, 2.5)
    check = {"name": "sft_bf16_z2", "expect": "ok"}
    assert gpu_check.judge(check, 0, "", got) == (False, "loss did not fall (2.0000 -> 2.5000)")
    assert gpu_check.judge(check, 1, "", got) == (False, "exit status 1")
    assert gpu_check.judge(check, None, "", got) == (False, "timed out")
    got["last_loss"] = 1.0
    assert gpu_check.judge(check, 0, "", got) == (True, "ok")


def test_generation_figures_count_the_answers_written(tmp_path):
    run = tmp_path / "generate_auto"
    run.mkdir()
    (run / "answers.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert gpu_check.numbers("generate_auto", run) == {"answers": 2}


def test_refusal_and_generation_verdicts():
    refused = {"name": "hybrid_refused", "expect": "refused", "needle": "cannot run the actor"}
    assert gpu_check.judge(refused, 1, "ConfigError: --enable_hybrid_engine cannot run the actor x", {})[0]
    assert gpu_check.judge(refused, 0, "", {}) == (False, "ran, but should have been refused")
    assert not gpu_check.judge(refused, 1, "CUDA error: out of memory", {})[0]
    gen = {"name": "generate_auto", "expect": "ok"}
    assert gpu_check.judge(gen, 0, "policy p on cuda in torch.bfloat16", {"answers": 64}) == (True, "ok")
    assert not gpu_check.judge(gen, 0, "policy p on cpu in torch.float32", {"answers": 64})[0]
    assert gpu_check.judge(gen, 0, "on cuda in torch.bfloat16", {}) == (False, "no answers written")


def test_report_lists_each_check_and_a_failures_log():
    results = [dict(name="a", ok=True, why="ok", seconds=3.2, numbers={"steps": 2, "x": 0.123456}, log_tail=""),
               dict(name="b", ok=False, why="exit status 1", seconds=1.0, numbers={}, log_tail="Traceback: boom")]
    text = gpu_check.report({"device": "NVIDIA H100", "torch": "2.11"}, results)
    assert "| a | ✔ ok | 3 | steps 2; x 0.1235 |" in text
    assert "| b | ✘ exit status 1 | 1 |  |" in text
    assert "## b: exit status 1" in text and "Traceback: boom" in text and "## a:" not in text
    assert "device NVIDIA H100" in text
