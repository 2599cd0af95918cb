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


def declared() -> set[str]:
    names = set()
    for req in ("requirements.txt", "requirements-dev.txt", "requirements-models.txt", "requirements-bench.txt"):
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
            dists = {normalise(d) for d in owners.get(mod, [])} or {normalise(mod)}
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
