"""The scheduler and the executor are peers over a shared floor (ipc/): neither imports the other."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.server_proc import ROOT


def _modules_after_import(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_scheduler_side_loads_no_torch_and_no_executor():
    mods = _modules_after_import(
        "import scheduler_proc.launch, scheduler_proc.server, scheduler_proc.planner, scheduler_proc.validate")
    assert "torch" not in mods
    assert "starlette" not in mods  # the HTTP stack is the gateway's: a server without --port runs without it
    assert not any(m == "executor_proc" or m.startswith("executor_proc.") for m in mods)


@pytest.fixture(scope="module")
def executor_modules() -> set[str]:
    """What the executor process's shell, its build and the GPU backend import (one process: torch's import is most
    of its cost)."""
    return _modules_after_import("import executor_proc.main, executor_proc.build, executor_proc.backends.triton_backend")


def test_executor_side_imports_no_scheduler(executor_modules):
    assert not any(m == "scheduler_proc" or m.startswith("scheduler_proc.") for m in executor_modules)


def test_executor_product_path_imports_no_test_doubles(executor_modules):
    """The process shell and the build reach executor_proc.testing only lazily (--load-format scripted),
    and no kernel module applies the Triton-interpreter patch on import."""
    assert not any(m.startswith("executor_proc.testing") for m in executor_modules)
    assert "kernels.interpreter_patch" not in executor_modules


PACKAGES = ("scheduler_proc", "executor_proc", "ipc", "kernels", "forerun")


def _import_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports anywhere in its text (top level, functions, TYPE_CHECKING)."""
    import ast
    import os

    files = {}
    for pkg in PACKAGES:
        for folder, _, names in os.walk(os.path.join(ROOT, pkg)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    files[mod.removesuffix(".__init__")] = path
    graph = {}
    for mod, path in files.items():
        package = mod.split(".") if path.endswith("__init__.py") else mod.split(".")[:-1]
        named = set()
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                named.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                named.add(base)
                named.update(f"{base}.{a.name}" for a in node.names)
        graph[mod] = set()
        for name in named:
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != mod:
                graph[mod].add(name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_loop():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    """No module of the project imports, even inside a function or under TYPE_CHECKING, a module that
    imports it back (directly or through others): shared types live in a small module both import."""
    graph = _import_graph()
    assert "scheduler_proc.planner" in graph and "ipc.client.stream" in graph
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(
        " <-> ".join(c) + " (" + ", ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) + ")" for c in cycles)
