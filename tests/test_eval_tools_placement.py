"""The evaluation tools load their models as step 3 does (issue 54.10): `marlhf eval-policy` in the run's --dtype
with --attn_implementation before the engines put them on the accelerator, and `marlhf judge`'s reward-model judge
on --device in --dtype."""

import torch
from conftest import save_seeded_reward_model


def test_eval_policy_loads_every_model_in_the_runs_dtype(embedded, tmp_path, monkeypatch):
    from marlhf.cli import eval_policy

    handed = []  # (class name, dtype, attention) of each model handed to its frozen engine

    def frozen_engine(model, **kw):
        handed.append((type(model).__name__, next(model.parameters()).dtype, model.config._attn_implementation,
                       kw["dtype"]))
        return model

    monkeypatch.setattr(eval_policy, "frozen_engine", frozen_engine)
    monkeypatch.setattr(eval_policy, "evaluate_policy", lambda *a, **k: {"stub": 1.0})
    reward = save_seeded_reward_model(tmp_path / "rm")
    nano = str(__import__("marlhf.embedded", fromlist=["prepare"]).prepare(size="nano").model_dir)
    code = eval_policy.main(["--actor_model_name_or_path", nano, "--ref_model_name_or_path", nano,
                             "--reward_model_name_or_path", str(reward), "--dtype", "bf16",
                             "--attn_implementation", "eager", "--max_eval_samples", "4",
                             "--output_dir", str(tmp_path / "out")])
    assert code == 0
    assert handed == [("LlamaForCausalLM", torch.bfloat16, "eager", "bf16"),
                      ("LlamaForCausalLM", torch.bfloat16, "eager", "bf16"),
                      ("LlamaForSequenceClassification", torch.bfloat16, "eager", "bf16")]


def test_judge_reward_model_on_the_device_in_the_dtype(tmp_path, monkeypatch):
    from marlhf.cli import judge
    from marlhf.rewards import reward_model as reward_mod

    loaded = []
    real = reward_mod.load_reward_model

    def spy(*a, **k):
        model = real(*a, **k)
        loaded.append(model)
        return model

    monkeypatch.setattr(reward_mod, "load_reward_model", spy)
    rm = save_seeded_reward_model(tmp_path / "rm")
    judge.local_judge("reward_model", str(rm), 0.0, 4, device="cpu", dtype="bf16", attn_implementation="eager")
    (model,) = loaded
    p = next(model.parameters())
    assert (p.dtype, p.device.type, model.config._attn_implementation) == (torch.bfloat16, "cpu", "eager")


def test_export_writes_the_dtype_asked_and_keeps_the_stored_one_by_default(tmp_path):
    from conftest import save_seeded_reward_model
    from safetensors import safe_open

    from marlhf.cli import export

    src = save_seeded_reward_model(tmp_path / "rm")  # a step-2 output folder, stored in float32

    def dtypes(folder):
        with safe_open(folder / "model.safetensors", framework="pt") as f:
            return {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 - safe_open is no dict

    assert export.main(["--input", str(src), "--output_dir", str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    assert dtypes(tmp_path / "bf16") == {torch.bfloat16}
    assert export.main(["--input", str(src), "--output_dir", str(tmp_path / "auto")]) == 0
    assert dtypes(tmp_path / "auto") == {torch.float32}
