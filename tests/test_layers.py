"""The package's import structure, read from its source: no import circles, and no module importing a layer above
its own — foundation (errors, utils) < components (data, models, code, the parser, the samplers, the embedded task's
parts) < the embedded default assembled from them < algorithms (rlhf, rewards, tasks, config, ...) < evaluation
(eval) < entry points (cli).  Imports under ``if TYPE_CHECKING:`` (annotations only) do not count."""

import ast
from pathlib import Path

from conftest import REPO

ROOT = REPO / "marlhf"
LAYERS = {  # a module's layer is that of the longest prefix it matches (a package prefix or a module)
    "marlhf.errors": 0, "marlhf.utils": 0,
    "marlhf.data": 1, "marlhf.models": 1, "marlhf.code": 1, "marlhf.parsing": 1, "marlhf.sampler": 1,
    "marlhf.vllm_sampler": 1,
    "marlhf.embedded.task": 1, "marlhf.embedded.code_task": 1, "marlhf.embedded.model": 1,
    "marlhf.embedded.tokenizer": 1,
    "marlhf.embedded": 1.5,  # the package itself builds the default from the task, a tokenizer and a model
    "marlhf.eval": 3,
    "marlhf.cli": 4, "marlhf.__main__": 4, "marlhf": 4,
}  # everything else (rlhf, rewards, tasks, supervised, dpo, config, loop, ...) is layer 2


def layer(module: str) -> float:
    matches = [p for p in LAYERS if module == p or (p != "marlhf" and module.startswith(p + "."))]
    return LAYERS[max(matches, key=len)] if matches else 2


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the marlhf modules it imports (the named submodule where one is named)."""
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        package = path.name == "__init__.py"
        found = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".") if package else name.split(".")[:-1]
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                subs = {f"{base}.{a.name}" for a in node.names} & mods.keys()
                found |= subs or ({base} & mods.keys())
        graph[name] = found - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_analysis_finds_a_circle_and_an_upward_import():
    graph = {"marlhf.utils.a": {"marlhf.data.b"}, "marlhf.data.b": {"marlhf.utils.a"}, "marlhf.cli.c": set()}
    assert cycles(graph) == [["marlhf.data.b", "marlhf.utils.a"]]
    assert layer("marlhf.utils.a") < layer("marlhf.data.b") < layer("marlhf.rlhf.x") < layer("marlhf.cli.c")
    assert layer("marlhf.embedded.task") < layer("marlhf.embedded") < layer("marlhf.rewards.gold") \
        < layer("marlhf.eval.x")
    real = imports(modules())  # the reader sees absolute, relative, submodule and function-local imports
    assert {"marlhf.rlhf.rollout", "marlhf.rlhf.advantages"} <= real["marlhf.rlhf.trainer"]
    assert "marlhf.rlhf.advantages" in real["marlhf.config"]  # imported inside a method
    assert "marlhf.sections" not in real["marlhf.utils.ds_engine"]  # only under TYPE_CHECKING


def test_no_import_circles():
    assert cycles(imports(modules())) == []


def test_no_module_imports_a_layer_above_its_own():
    graph = imports(modules())
    upward = sorted((m, t) for m, targets in graph.items() for t in targets if layer(t) > layer(m))
    assert upward == []


def takers_of_the_flags(source: str) -> list[str]:
    """Functions of ``source`` that receive the whole parsed flag object: a parameter named ``args`` or a read of
    ``self.args``.  ``Section.build`` (marlhf/utils/flags.py), the one builder of the sections, is where the flags
    are cut, so it is not counted."""
    out = []
    tree = ast.parse(source)
    builders = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == "Section"
                for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "build"}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or id(node) in builders:
            continue
        params = {a.arg for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs}
        self_args = any(isinstance(n, ast.Attribute) and n.attr == "args" and isinstance(n.value, ast.Name)
                        and n.value.id == "self" for n in ast.walk(node))
        if "args" in params or self_args:
            out.append(node.name)
    return out


def test_the_flags_stop_at_the_entry_points():
    """Only the entry points (cli/) hold the parsed flags; the library receives sections (each built by its
    ``Section.build``) and explicit values.  Checked on a synthetic module that it finds both kinds of taker, and
    that a per-section builder (a ``from_args`` of old) counts as one."""
    toy = ("class Section:\n    @classmethod\n    def build(cls, args): ...\n"
           "class S:\n    @classmethod\n    def from_args(cls, args): ...\n"
           "def build(args, tok): ...\n"
           "class T:\n    def step(self):\n        return self.args.lr\n")
    assert takers_of_the_flags(toy) == ["build", "from_args", "step"]
    takers = {f"{path.relative_to(REPO)}:{name}" for path in ROOT.rglob("*.py")
              if "cli" not in path.relative_to(ROOT).parts for name in takers_of_the_flags(path.read_text())}
    assert takers == set()
