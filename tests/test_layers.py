"""The package's layers point down only, and no two parts import each other.

hardware/errors/dtypes/files/manifest -> backends/_ext/heap -> ops/triton -> patching -> models -> data/train/
generation/export/evaluation/serve/image/ui (+ bench, testing, demo) -> commands. Every ``import`` counts,
including the lazy ones inside functions: a lazy import upward is still an upward dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lorafuse

ROOT = Path(lorafuse.__file__).resolve().parent
LAYERS = [
    {"hardware", "errors", "dtypes", "files", "manifest"},
    {"backends", "_ext", "heap"},
    {"ops", "triton"},
    {"patching"},
    {"models"},
    {"data", "train", "generation", "batch_infer", "decode", "export", "evaluation", "serve",
     "bench", "roofline", "testing", "demo", "image", "ui"},
    {"commands", "__main__"},
]  # fmt: skip
LEVEL = {part: i for i, layer in enumerate(LAYERS) for part in layer}
# ``from lorafuse import NAME`` for the names the package root re-exports lazily (None: its own)
ROOT_EXPORTS = {"FastLanguageModel": "models", "patch_peft_model": "patching",
                "unpatch_peft_model": "patching", "__version__": None}  # fmt: skip


def part_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return rel.parts[0]


def imported_parts(path: Path) -> set[str]:
    """The top-level parts of lorafuse that ``path`` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "lorafuse":
                names = [f"lorafuse.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] != "lorafuse" or len(parts) < 2:
                continue
            found.add(ROOT_EXPORTS.get(parts[1], parts[1]))
    return found - {None}


def dependency_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        if path == ROOT / "__init__.py":
            continue  # the package root re-exports the public API lazily
        part = part_of(path)
        graph.setdefault(part, set()).update(imported_parts(path) - {part})
    return graph


def test_every_part_has_a_layer():
    assert set(dependency_graph()) <= set(LEVEL), set(dependency_graph()) - set(LEVEL)


def test_no_upward_import():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == ROOT / "__init__.py":
            continue
        part = part_of(path)
        for dep in imported_parts(path):
            if LEVEL.get(dep, -1) > LEVEL[part]:
                upward.append(f"{path.relative_to(ROOT)} ({part}) imports {dep}")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_import_cycle_between_parts():
    cycle = find_cycle(dependency_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checker_sees_lazy_and_root_imports(tmp_path):
    """The walker must not miss what makes a layer violation: imports inside functions and
    ``from lorafuse import NAME``."""
    f = tmp_path / "m.py"
    f.write_text(
        "def g():\n    from lorafuse.commands import main\n    from lorafuse import FastLanguageModel\n"
    )
    assert imported_parts(f) == {"commands", "models"}


def test_library_code_never_imports_the_testing_helpers():
    """``lorafuse.testing`` is for tests and benchmarks: an installed library that needed it would
    carry pytest-shaped helpers into every user's process."""
    offenders = [
        str(path.relative_to(ROOT))
        for path in sorted(ROOT.rglob("*.py"))
        if part_of(path) != "testing" and "testing" in imported_parts(path)
    ]
    assert not offenders, offenders


# Modules that may call a compiled kernel directly besides ops/, triton/ and the loaders, and why.
KERNEL_CALLERS = {
    "heap.py": "the large-buffer allocator is the extension's, not an op",
}


def kernel_calls(path: Path) -> list[str]:
    """How ``path`` reaches a compiled kernel itself: ``backends.compiled(...)``, the loaded
    extension (``load_cpp()``), or either name imported to be called bare."""
    text = path.read_text()
    found = [call for call in ("backends.compiled(", "load_cpp(") if call in text]
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.ImportFrom) and node.module in (
            "lorafuse.backends",
            "lorafuse._ext",
        ):
            found += [a.name for a in node.names if a.name in ("compiled", "load_cpp")]
    return found


def test_compiled_kernels_are_called_from_ops_only():
    """Decoding, patching and the models reach a kernel through an op's entry point, so the op's
    one policy block (and ``backends``) decides, never a second place."""
    offenders = [
        f"{path.relative_to(ROOT)}: {kernel_calls(path)}"
        for path in sorted(ROOT.rglob("*.py"))
        if part_of(path) not in ("ops", "triton", "backends", "_ext")
        and str(path.relative_to(ROOT)) not in KERNEL_CALLERS
        and kernel_calls(path)
    ]
    assert not offenders, offenders


def test_the_kernel_call_check_sees_every_form(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "from lorafuse import backends, _ext\nfrom lorafuse.backends import compiled\n"
        "def g():\n    backends.compiled('rope', 'cpp', 'forward')\n    _ext.load_cpp()\n"
    )
    assert kernel_calls(f) == ["backends.compiled(", "load_cpp(", "compiled"]
    f.write_text(
        "from lorafuse.ops import rope\ndef g(q, k, c, s):\n    return rope.apply_rope(q, k, c, s)\n"
    )
    assert kernel_calls(f) == []


def module_name(path: Path) -> str:
    if not path.is_relative_to(ROOT):
        return path.stem  # a file written by a test
    rel = path.relative_to(ROOT.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


MODULES = {module_name(p) for p in ROOT.rglob("*.py")}


def imported_modules(path: Path, tree: ast.AST | None = None) -> dict[str, str]:
    """``{local name: lorafuse module}`` for every lorafuse module imported in ``tree`` (default:
    the whole file, lazy imports included); ``from lorafuse.ops.x import name`` counts as an
    import of ``lorafuse.ops.x`` (under a key with a space, so it binds no local name)."""
    found: dict[str, str] = {}
    for node in ast.walk(tree or ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES:
                    found[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in MODULES:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in MODULES:
                    found[a.asname or a.name] = full
                else:
                    found[f" {node.module}"] = node.module
    return found


def runtime_imports(tree: ast.AST) -> ast.Module:
    """``tree`` without its ``if TYPE_CHECKING:`` blocks: imports for annotations never run."""

    class Strip(ast.NodeTransformer):
        def visit_If(self, node: ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                return node.orelse or None
            return self.generic_visit(node)

    return Strip().visit(tree)


def folder_graphs() -> dict[Path, dict[str, set[str]]]:
    """Per folder of the package: ``{module: modules of the same folder it imports}``, every
    import counted (lazy ones inside functions too), ``if TYPE_CHECKING:`` blocks not."""
    graphs: dict[Path, dict[str, set[str]]] = {}
    for path in ROOT.rglob("*.py"):
        tree = runtime_imports(ast.parse(path.read_text(), str(path)))
        here = module_name(path)
        package = here if path.name == "__init__.py" else here.rpartition(".")[0]
        graphs.setdefault(path.parent, {})[here] = {
            m
            for m in imported_modules(path, tree).values()
            if m != here and (m == package or m.rpartition(".")[0] == package)
        }
    return graphs


def test_no_import_cycle_inside_any_folder():
    """The modules of one folder import each other (lazy imports included) without a circle: a
    shared helper lives in a module that imports none of its users."""
    cycles = [
        f"{folder.relative_to(ROOT.parent)}: " + " -> ".join(cycle)
        for folder, graph in sorted(folder_graphs().items())
        if (cycle := find_cycle(graph))
    ]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_folder_cycle_check_sees_lazy_imports_and_skips_type_checking(tmp_path, monkeypatch):
    """A circle closed by a lazy import is found; one closed only under TYPE_CHECKING is not."""
    pkg = tmp_path / "lorafuse"
    (pkg / "train").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "train" / "__init__.py").write_text("")
    (pkg / "train" / "a.py").write_text("from lorafuse.train import b\n")
    (pkg / "train" / "b.py").write_text("def f():\n    from lorafuse.train.a import x\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    monkeypatch.setattr(
        __import__(__name__), "MODULES", {module_name(p) for p in pkg.rglob("*.py")}
    )
    graph = folder_graphs()[pkg / "train"]
    assert find_cycle(graph) == ["lorafuse.train.a", "lorafuse.train.b", "lorafuse.train.a"]
    (pkg / "train" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lorafuse.train.a import x\n"
    )
    assert find_cycle(folder_graphs()[pkg / "train"]) is None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path + [node, dep]
            if dep not in state and (cycle := visit(dep, path + [node])):
                return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [])):
            return cycle
    return None


def private_uses(path: Path) -> list[str]:
    """Private names of a lorafuse module used from another module: ``from lorafuse.x import _y``
    and ``x._y`` on a module bound by an import (a private module such as ``lorafuse._ext`` is
    fine: the name is the module's, not one of its internals)."""
    me, found = module_name(path), []
    tree = ast.parse(path.read_text(), str(path))
    top = ast.Module([n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], [])
    module_level = imported_modules(path, top)

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    for stmt in tree.body:  # a lazy import binds its name in its own top-level function only
        aliases = module_level | imported_modules(path, stmt)
        for node in ast.walk(stmt):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in MODULES:
                if node.module != me:
                    names = [f"{node.module}.{a.name}" for a in node.names if private(a.name)]
                    found += [n for n in names if n not in MODULES]  # a private module is fine
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                target = aliases.get(node.value.id, "")
                if target.startswith("lorafuse") and target != me and private(node.attr):
                    if f"{target}.{node.attr}" not in MODULES:
                        found.append(f"{target}.{node.attr}")
    return found


def test_no_private_name_used_from_another_module():
    """What another module needs from an op is that op's public API: a private name used from
    outside ties the two files' internals together."""
    offenders = [
        f"{p.relative_to(ROOT)} uses {use}"
        for p in sorted(ROOT.rglob("*.py"))
        for use in private_uses(p)
    ]
    assert not offenders, "\n".join(offenders)


def test_the_layer_checks_see_cycles_and_private_uses(tmp_path):
    """Both ops/ rules can fail: a lazy import back and both forms of a private use are seen."""
    a = tmp_path / "a.py"
    a.write_text(
        "from lorafuse.ops.cross_entropy import _lowp_implementation\n"
        "from lorafuse.data.formats import _private_helper\n"
        "from lorafuse import _ext\n"
        "def f():\n    from lorafuse.ops import swiglu as s\n    return s._torch_forward\n"
    )
    assert imported_modules(a) == {
        " lorafuse.ops.cross_entropy": "lorafuse.ops.cross_entropy",
        " lorafuse.data.formats": "lorafuse.data.formats",
        "_ext": "lorafuse._ext",
        "s": "lorafuse.ops.swiglu",
    }
    assert sorted(private_uses(a)) == [
        "lorafuse.data.formats._private_helper",
        "lorafuse.ops.cross_entropy._lowp_implementation",
        "lorafuse.ops.swiglu._torch_forward",
    ]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
