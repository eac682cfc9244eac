"""Data flows one way (see GUIDE.md): the allocator and page table import no torch, nothing below the layers
imports transformers, and lower modules never import higher ones."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "hf_kvcache"
ORDER = [
    "errors",
    "quant",
    "config",
    "allocator",
    "page_table",
    "pool",
    "kernels",
    "layers",
    "attention",
    "caches",
    "integration",
]


def imports_of(module: str) -> set[str]:
    path = PACKAGE / f"{module}.py"
    files = [path] if path.exists() else sorted((PACKAGE / module).glob("*.py"))
    names = set()
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
    return names


@pytest.mark.parametrize("module", ORDER)
def test_imports_flow_one_way(module):
    names = imports_of(module)
    ours = {name.split(".")[1] for name in names if name.startswith("hf_kvcache.")}
    top = {"eval", "bench", "bench_ring", "measure", "models", "soak", "cards"}  # library code above the caches
    higher = set(ORDER[ORDER.index(module) + 1 :]) | top
    assert not ours & higher, f"{module} imports higher modules {ours & higher}"
    if ORDER.index(module) < ORDER.index("layers"):
        assert not any(name.startswith("transformers") for name in names), f"{module} imports transformers"
    if module in ("allocator", "page_table", "errors"):
        assert not any(name.startswith("torch") for name in names), f"{module} imports torch"
