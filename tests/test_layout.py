"""The package's architecture, checked: layers import only downwards, no module imports
itself back through another (function-level imports count), and the generator finds the
data installed with ttile when run outside a checkout."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

import ttile

PACKAGE = Path(ttile.__file__).parent
#: Each layer may import itself and the layers listed (the extension and _version are
#: below every layer). The top-level package and the CLI sit above all of them.
ALLOWED = {
    "core": {"core"},
    "tuning": {"core", "tuning"},
    "generator": {"core", "tuning", "generator"},
    "runtime": {"core", "tuning", "generator", "runtime"},
    # the front ends: a PyTorch model, and an ONNX model (served through the former)
    "torch": {"core", "tuning", "generator", "runtime", "torch"},
    "onnx": {"core", "tuning", "generator", "runtime", "torch", "onnx"},
}
LEAVES = {"ttile._kernels", "ttile._version"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every ttile module ``path`` imports, at any depth of the file."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("ttile")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("ttile"):
                continue
            for alias in node.names:  # "from . import dispatch" imports a module
                candidate = f"{target}.{alias.name}"
                out.add(candidate if _exists(candidate) else target)
    return out


def _exists(module: str) -> bool:
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists() \
        or module == "ttile._kernels"


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        graph[_module_name(path)] = _imports(path)
    return graph


def test_layers_import_only_downwards():
    wrong = []
    for module, targets in _graph().items():
        parts = module.split(".")
        if len(parts) < 3 or parts[1] not in ALLOWED:
            continue  # ttile, ttile.cli, the layers' own __init__
        for target in targets - LEAVES:
            layer = target.split(".")[1] if target.count(".") else ""
            if layer not in ALLOWED[parts[1]]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, wrong


def test_no_import_cycles():
    graph = {m: {t for t in ts if t != m} for m, ts in _graph().items()}
    # the package __init__ re-exports the API; a module of a layer importing "ttile"
    # itself would close a cycle through it (the CLI, which nothing imports, may)
    assert not [m for m, ts in graph.items()
                if "ttile" in ts and m.split(".")[1:2] and m.split(".")[1] in ALLOWED]
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state and module != "ttile":
            visit(module, [module])
    assert not cycles, cycles


def test_the_layout_has_the_four_layers():
    for layer in ALLOWED:
        assert (PACKAGE / layer / "__init__.py").exists()
    assert _graph()["ttile.runtime.routes"] >= {"ttile.core.spec", "ttile.runtime.dispatch"}


def test_the_generator_reads_tables_installed_with_ttile(tmp_path):
    """Outside a checkout (no ./generator), tables come from the installed copy."""
    pytest.importorskip("islpy")
    from ttile.generator.data import DataKind, installed_directory
    from ttile.generator.microkernels import MicrokernelTable, load_table
    installed = installed_directory(DataKind.MICROKERNELS)
    if installed is None:
        pytest.skip("this install carries no tables (editable install)")
    path = sorted(installed.glob("*.json"))[0]
    cpu = MicrokernelTable.from_json(__import__("json").loads(path.read_text())).cpu
    table = load_table(tmp_path / "no-data-here", cpu=cpu)
    assert table.cpu == cpu
    with pytest.raises(FileNotFoundError, match=str(installed)):
        load_table(tmp_path / "no-data-here", cpu=type(cpu)(**{**cpu.__dict__,
                                                              "model": "no-such-model"}))
    # and the command, run from an empty directory
    out = subprocess.run([sys.executable, "-m", "ttile.cli", "model", "--layer",
                          "ResNet18-12", "--top", "1"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    from ttile.core.cpuinfo import fingerprint
    from ttile.core.vectors import family_stem
    from ttile.generator.data import find_cpu_file
    from ttile.core.kinds import Isa
    own = find_cpu_file(DataKind.MICROKERNELS, family_stem(fingerprint().id, Isa.AVX512F),
                        tmp_path / "no-data-here")
    if own is not None:   # its own table, or one measured on the same microarchitecture
        assert "using a default microkernel" not in out.stderr
    else:  # no table for this core: the note says where it looked
        assert str(installed) in out.stderr
