"""The house's rules, checked on the code: no import cycles, arrows only downwards, every module
importable on its own, and imports at the top of the module unless there is a stated reason.

The layers are the ones docs/architecture.md draws; an import is an arrow from its module to the
module it names, wherever it stands (a function-level import that hides a cycle is still one).
"""

import ast
import collections
import functools
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAYERS = [  # lowest first: a module may import its own layer and the ones below
    (
        "megapar.device",
        "megapar.faults",
        "megapar.comm_count",
        "megapar.comm_wait",
        "megapar.shared_gpu",
        "megapar.graph_break",
        "megapar.one_line_parser",
        "megapar.made_dirs",
        "megapar.disk",
        "megapar.wording",
        "megapar.host_memory",
        "megapar.env_seconds",
    ),
    ("megapar.mesh", "megapar.launcher"),
    ("megapar.tensor_parallel", "megapar.context_parallel", "megapar.expert_parallel"),
    (
        "megapar.models",
        "megapar.pipeline",
        "megapar.data_parallel",
        "megapar.optim",
        "megapar.checkpoint",
        "megapar.data",
    ),
    ("megapar.diagnostics",),
    ("megapar.training",),
    ("megapar.plan", "megapar.dryrun"),
    ("megapar.cli", "megapar"),
]

LAZY_FILES = {
    "megapar/__init__.py": "the public API is imported lazily, so `import megapar` is cheap",
    "megapar/cli/data.py": "megapar-data answers --help and bad input before torch is imported",
    "megapar/cli/convert.py": "megapar-convert answers --help and bad input before torch is "
    "imported",
    "megapar/cli/bubble.py": "megapar-bubble answers --help and bad input, and simulates from "
    "given costs, before torch is imported",
}
"""Files whose function-level imports are deliberate, and why."""
LAZY_PACKAGES = {
    "matplotlib": "optional: plots only",
    "wandb": "optional: --wandb-project only",
    "torch.utils.tensorboard": "optional: --tensorboard only",
    "pyarrow": "Parquet input only",
    "IPython": "notebook detection only",
    "transformers": "heavy (seconds): HF import / export only",
    "torchao": "optional (megapar[fp8]): --fp8 only",
    "torch._dynamo": "heavy (1.2 s): imported by the launcher before forking the workers, "
    "whose torch optimizers import it (megapar.graph_break)",
}
"""Libraries any module may import where it uses them, and why."""


def modules() -> dict[str, str]:
    """{dotted name: path} of every megapar module."""
    out = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, "megapar")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


MODULES = modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> list[tuple[str, int, bool]]:
    """(imported megapar module, line, inside a function) for every import of `module`."""
    path = MODULES[module]
    tree = ast.parse(open(path).read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = []
    todo = collections.deque([(tree, False)])  # ast.walk's order, each node with whether a
    while todo:  # function holds it (one pass: walking each function's subtree again was 1 s)
        node, in_function = todo.popleft()
        in_function = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        todo.extend((child, in_function) for child in ast.iter_child_nodes(node))
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        for name in names:
            target = _resolve(name) if name.startswith("megapar") else None
            if target and target != module:
                found.append((target, node.lineno, in_function))
    return found


@functools.cache
def graph() -> dict[str, list[tuple[str, int, bool]]]:
    """{module: imports_of(module)} for every megapar module, parsed when a test first asks
    (not at collection, where every pytest-xdist worker would parse all of megapar: 1.2 s)."""
    return {m: imports_of(m) for m in MODULES}


def test_no_import_cycles():
    arrows = graph()
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w, _, _ in arrows[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in arrows:
        if v not in index:
            visit(v)
    described = [
        " <-> ".join(c)
        + ": "
        + ", ".join(
            f"{m} imports {t} (line {line})" for m in c for t, line, _ in arrows[m] if t in c
        )
        for c in cycles
    ]
    assert not cycles, "import cycles:\n" + "\n".join(described)


def _layer(module: str) -> int | None:
    """The layer of `module`: its longest prefix's in LAYERS ("megapar" is the package itself,
    not a prefix of every module); None where none is."""
    found = [
        (i, len(prefix))
        for i, names in enumerate(LAYERS)
        for prefix in names
        if module == prefix or (prefix != "megapar" and module.startswith(prefix + "."))
    ]
    return max(found, key=lambda x: x[1])[0] if found else None


def test_every_module_has_a_layer_and_no_arrow_runs_back_up():
    """ "megapar" matched every module as a prefix, so a module on no layer landed on the top
    one without a word (an architecture review's finding)."""
    unplaced = sorted(m for m in MODULES if _layer(m) is None)
    assert not unplaced, f"modules on no layer of LAYERS: {unplaced}"
    assert _layer("megapar.not_on_the_map") is None
    arrows = graph()
    upward = [
        f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)}) at line {line}"
        for m, targets in arrows.items()
        for t, line, _ in targets
        if _layer(t) > _layer(m)
    ]
    assert not upward, "imports that run back up:\n" + "\n".join(upward)


def test_models_never_import_the_pipeline_or_the_cli():
    bad = [
        (m, t)
        for m, targets in graph().items()
        if m.startswith("megapar.models")
        for t, _, _ in targets
        if t.startswith(("megapar.pipeline", "megapar.cli", "megapar.training"))
    ]
    assert not bad


def test_every_module_imports_on_its_own():
    """Imported alone (no other megapar module loaded first), each module works: none relies
    on an import order. And none imports torch._dynamo (1.2 s of every command's start-up):
    functions compiled code calls eagerly are marked with `megapar.graph_break`, which
    imports it at their first call. Before each import the last one's garbage is collected and
    what survives (torch's modules, megapar's registrations in them) frozen, so the collections
    the imports trigger walk only that import's objects, not torch's heap each time."""
    script = (
        "import gc, importlib, sys\n"
        f"names = {sorted(MODULES)!r}\n"
        "bad = []\n"
        "for name in names:\n"
        "    for loaded in [m for m in sys.modules if m == 'megapar' or m.startswith('megapar.')]:\n"
        "        del sys.modules[loaded]\n"
        "    gc.collect()\n"
        "    gc.freeze()\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        bad.append(f'{name}: {type(exc).__name__}: {exc}')\n"
        "if 'torch._dynamo' in sys.modules:\n"
        "    bad.append('torch._dynamo was imported')\n"
        "print('\\n'.join(bad))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "", run.stdout


def test_the_commands_that_answer_before_torch_do_not_import_it():
    """LAZY_FILES' megapar-data, megapar-convert and megapar-bubble: importing them (their
    parser, --help, bad input) imports no torch (0.2 s instead of 2.5), nor does megapar-bubble's
    simulation from given costs or its refusal of a bad size."""
    script = (
        "import sys, megapar.cli.data, megapar.cli.convert, megapar.cli.bubble as b\n"
        "assert b.main(['--pp', '4', '-m', '8', '--simulate', '--fwd-ms', '1']) == 0\n"
        "assert b.main(['--pp', '0', '-m', '8', '--simulate', '--fwd-ms', '1']) == 2\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=True,
    )
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout[-300:]


def test_imports_are_at_the_top_unless_there_is_a_stated_reason():
    late = []
    for module, path in MODULES.items():
        rel = os.path.relpath(path, ROOT)
        if rel in LAZY_FILES:
            continue
        tree = ast.parse(open(path).read())
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                else:
                    continue
                for name in names:
                    if not name.startswith(tuple(LAZY_PACKAGES)):
                        late.append(f"{rel}:{node.lineno} imports {name} inside {func.name}()")
    assert not late, (
        "imports inside functions without a stated reason (move them to the top, "
        "or add the reason to LAZY_FILES / LAZY_PACKAGES):\n" + "\n".join(late)
    )
