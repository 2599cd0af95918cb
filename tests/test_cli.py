"""The installed ``marlhf`` command: its subcommands, their grouped --help, and the errors of a bad call.
(The 2-rank ``deepspeed --module marlhf.cli.ppo`` run is tests/test_step3.py's two-rank test; the README's
own-model commands run in tests/test_readme.py.)"""

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from marlhf.cli import COMMANDS
from marlhf.cli.main import main as marlhf_main

# one subcommand per entry point of the old layout, and the main job
EXPECTED = {"sft", "rm", "label", "dpo", "ppo", "quickstart", "generate", "score-pairs", "score-policies",
            "eval-policy", "judge", "best-of-n", "pass-at-k", "execute", "chat", "export"}


def test_every_entry_point_is_a_subcommand_with_a_main():
    assert set(COMMANDS) == EXPECTED
    for name, (module, _) in COMMANDS.items():
        assert callable(importlib.import_module(f"marlhf.cli.{module}").main), name


def test_console_script_lists_every_subcommand_with_one_line():
    exe = shutil.which("marlhf", path=str(Path(sys.executable).parent))
    assert exe, "pip install -e . installs the marlhf console script beside python"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    listed = {line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ") and line.split()}
    assert listed == EXPECTED
    assert "--module marlhf.cli." in out.stdout  # how to run it on several GPUs


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_subcommand_help(name, capsys):
    with pytest.raises(SystemExit) as stop:
        marlhf_main([name, "--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: marlhf {name}")


def test_training_help_groups_flags_by_section(capsys):
    with pytest.raises(SystemExit):
        marlhf_main(["ppo", "--help"])
    text = capsys.readouterr().out
    sections = ["data:", "optimisation:", "DeepSpeed / precision:", "LoRA:", "sampling:", "models and their engines:",
                "policy and KL:", "macro actions:", "rewards and advantages:", "PPO update:", "reward source:"]
    at = [text.index(f"\n{s}\n") for s in sections]  # each section a group heading of its own, in order
    assert at == sorted(at)
    # a flag sits under the section that declares it: --ngram under "macro actions", before the next section
    assert text.index("\nmacro actions:\n") < text.index("--ngram") < text.index("\nrewards and advantages:\n")
    assert text.index("\ndata:\n") < text.index("--data_path") < text.index("\noptimisation:\n")


def test_unknown_subcommand_exits_2_and_suggests(capsys):
    assert marlhf_main(["score_pairs"]) == 2
    err = capsys.readouterr().err
    assert "unknown subcommand 'score_pairs'" in err and "did you mean 'score-pairs'" in err
    assert marlhf_main([]) == 0 and "subcommands:" in capsys.readouterr().out


@pytest.mark.parametrize("old,new", [("rw-eval", "score-pairs"), ("rm-eval", "score-policies")])
def test_renamed_subcommands_still_run_and_say_their_new_name(old, new, capsys):
    with pytest.raises(SystemExit) as stop:
        marlhf_main([old, "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr()
    assert f"'{old}' is now 'marlhf {new}'" in out.err and out.out.startswith(f"usage: marlhf {new}")


def test_a_user_error_through_the_command_is_one_line_and_status_1(tmp_path):
    # a new process, as a user starts it: without the rank variables an in-process run of this worker left behind
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK",
                                                          "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-m", "marlhf", "sft", "--model_name_or_path", str(tmp_path / "nope"),
                          "--output_dir", str(tmp_path / "o")], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "nope" in last and "Traceback" not in out.stderr


def test_version_flag_prints_the_installed_version():
    from importlib import metadata

    for flag in ("--version", "-V"):
        out = subprocess.run([sys.executable, "-m", "marlhf", flag], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"marlhf {metadata.version('marlhf')}"


@pytest.mark.parametrize("name", ["ppo", "sft", "rm", "dpo"])
def test_training_help_imports_no_torch(name):
    """`marlhf ppo --help` took 3-7 s while the step's module imported torch and DeepSpeed (and config.py
    imported DeepSpeed for its --deepspeed flags) before reading a flag: the help must come from the flags alone."""
    probe = ("import contextlib, io, sys\n"
             "from marlhf.cli.main import main\n"
             "with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
             f"    main([{name!r}, '--help'])\n"
             "assert out.getvalue().startswith('usage: marlhf'), out.getvalue()[:200]\n"
             "print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
