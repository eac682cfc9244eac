"""Data flows one way (see GUIDE.md). The core is one package per layer, lowest first: ``memory`` (pages and who
holds them), ``attention`` (reading pages for transformers' attention), ``layers``, ``caches``, ``integration`` (the
glue ``generate`` sees); beneath them ``errors``, and ``transformers_internals``, the one module that reaches past
transformers' top-level names. A package imports only packages before it, and inside a package a module imports
only the modules before it. ``memory`` imports no transformers; the allocator, page table, prefix index and
errors import no torch. The core never imports the tools (testing, bundled, eval, bench, cards)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "hf_kvcache"
ORDER = ["errors", "memory", "transformers_internals", "attention", "layers", "caches", "integration"]
"""The core's packages (and two modules), lowest first: each imports only those before it."""
INSIDE = {
    "memory": [
        *("quant", "dequant", "format", "device_memory", "prefix_index", "allocator", "page_table", "placement"),
        *("storage", "page_bytes", "store", "tiers", "pools", "stats", "page_pool", "pool"),
    ],
    "attention": ["kernels", "block_mask", "flex", "reads", "interface"],
    "layers": [
        "plan",
        "identical",
        "exact",
        "key_codes",
        "keys",
        "store",
        "read_path",
        "planned",
        "rows",
        "window",
        "paged",
    ],
    "caches": [
        "config",
        "policy",
        "fingerprint",
        "state_tails",
        "prefix",
        "binder",
        "state_layers",
        "planned",
        "compressed",
        "admission",
        "base",
        "entry",
        "paged",
        "quantized",
        "quantized_kv",
        "ring",
    ],
    "integration": ["registry", "seams", "warmup"],
}
"""Each core package's modules, lowest first: a module imports only the modules before it in its package."""
NO_TORCH = ["errors", "memory/allocator", "memory/page_table", "memory/prefix_index"]
TOOLS = ["testing", "bundled", "eval", "bench", "cards"]
"""Library code on top of the core; each may import the core and the tools it lists in ``TOOL_IMPORTS``."""
TOOL_IMPORTS = {
    "testing": set(),
    "bundled": set(),
    "eval": {"bundled"},
    "bench": {"testing", "bundled", "eval"},
    "cards": {"bundled", "eval"},
}
CORE_FREE = {"testing", "bundled/wheels"}
"""Tools (or a tool's modules) that import nothing of the core: tiny models need only transformers, and fetching
files from PyPI needs no cache."""
PACKAGES = {"bundled", "eval", "bench", "cards"}
"""Tool packages: another tool imports their public names (``from hf_kvcache.eval import ...``), not their modules."""


def source_files(module: str) -> list[Path]:
    path = PACKAGE / f"{module}.py"
    return [path] if path.exists() else sorted((PACKAGE / module).rglob("*.py"))


def imports_of(module: str) -> set[str]:
    names = set()
    for file in source_files(module):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                folder = PACKAGE.parent.joinpath(*node.module.split("."))
                # from hf_kvcache import caches; from hf_kvcache.memory import pool: modules, not names
                names |= {f"{node.module}.{a.name}" for a in node.names if (folder / f"{a.name}.py").exists()}
                names |= {f"{node.module}.{a.name}" for a in node.names if (folder / a.name).is_dir()}
    return names


def ours(names: set[str]) -> set[str]:
    """The top-level parts of hf_kvcache among ``names`` (``hf_kvcache.caches.base`` -> ``caches``)."""
    return {name.split(".")[1] for name in names if name.startswith("hf_kvcache.")}


def test_every_module_is_placed():
    found = {path.stem for path in PACKAGE.glob("*.py")} | {path.name for path in PACKAGE.iterdir() if path.is_dir()}
    assert found - {"__init__", "__pycache__"} == set(ORDER) | set(TOOLS)
    for package, modules in INSIDE.items():
        inside = {path.stem for path in (PACKAGE / package).glob("*.py")} - {"__init__"}
        assert inside == set(modules), f"{package}: {sorted(inside)} against INSIDE's {sorted(modules)}"


@pytest.mark.parametrize("package", INSIDE)
def test_every_core_package_says_what_each_of_its_modules_owns(package):
    docstring = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text())) or ""
    unnamed = [module for module in INSIDE[package] if f"``{module}``" not in docstring]
    assert not unnamed, f"hf_kvcache/{package}/__init__.py's docstring does not name {unnamed}"


@pytest.mark.parametrize("module", ORDER)
def test_imports_flow_one_way(module):
    names = imports_of(module)
    higher = set(ORDER[ORDER.index(module) + 1 :])
    assert not ours(names) & higher, f"{module} imports higher packages {ours(names) & higher}"
    if ORDER.index(module) < ORDER.index("transformers_internals"):
        assert not any(name.startswith("transformers") for name in names), f"{module} imports transformers"


@pytest.mark.parametrize(
    "package, module", [(package, module) for package, modules in INSIDE.items() for module in modules]
)
def test_inside_a_package_imports_flow_one_way(package, module):
    names = {name for name in imports_of(f"{package}/{module}") if name.startswith(f"hf_kvcache.{package}.")}
    higher = set(INSIDE[package][INSIDE[package].index(module) + 1 :])
    used = {name.split(".")[2] for name in names}
    assert not used & higher, f"{package}.{module} imports {sorted(used & higher)}, after it in INSIDE"


@pytest.mark.parametrize("module", NO_TORCH)
def test_the_bookkeeping_imports_no_torch(module):
    assert not any(name.startswith("torch") for name in imports_of(module)), f"{module} imports torch"


@pytest.mark.parametrize("module", ORDER)
def test_the_core_never_imports_eval_bench_or_cards(module):
    tools = ours(imports_of(module)) & set(TOOLS)
    assert not tools, f"the core module {module} imports the tools {tools}"


@pytest.mark.parametrize("tool", TOOLS)
def test_tools_import_each_other_only_as_listed(tool):
    used = ours(imports_of(tool)) & set(TOOLS) - {tool}
    assert used <= TOOL_IMPORTS[tool], f"{tool} imports {used - TOOL_IMPORTS[tool]}, not in TOOL_IMPORTS"


@pytest.mark.parametrize("module", sorted(CORE_FREE))
def test_core_free_tools_import_nothing_of_the_core(module):
    assert not ours(imports_of(module)) & set(ORDER), f"{module} imports the core"


@pytest.mark.parametrize("tool", TOOLS)
def test_tools_use_other_tool_packages_only_through_their_public_names(tool):
    inner = sorted(
        name
        for name in imports_of(tool)
        if any(name.startswith(f"hf_kvcache.{package}.") for package in PACKAGES - {tool})
    )
    assert not inner, f"{tool} imports {inner}: import the package's public names instead"


@pytest.mark.parametrize("module", ORDER + TOOLS)
def test_only_transformers_internals_reaches_past_the_public_names(module):
    """Everywhere else, transformers is imported as ``transformers`` or ``from transformers import ...``."""
    if module == "transformers_internals":
        return
    deep = sorted(name for name in imports_of(module) if name.startswith("transformers."))
    assert not deep, f"{module} imports {deep}: reach them through hf_kvcache.transformers_internals"


def test_layout_block_is_the_tree():
    """docs/layout.md's Layout block names every module of the package, under its folder, and nothing else."""
    readme = (PACKAGE.parent / "docs" / "layout.md").read_text()
    block = readme.split("## Layout\n\n```\n", 1)[1].split("```", 1)[0]
    listed, folder = set(), ""
    for line in block.splitlines()[1:]:
        indent = len(line) - len(line.lstrip())
        if indent == 0:
            break
        names = [word for word in line.strip().split("  ")[0].split() if word.endswith((".py", ".md", "/"))]
        if indent == 2:
            folder = names[0] if names[0].endswith("/") else ""
            listed |= {names[0]} if folder else set(names)
        else:
            listed |= {folder + name for name in names}
    found = {
        path.relative_to(PACKAGE).as_posix() + ("/" if path.is_dir() else "")
        for path in [*PACKAGE.glob("*"), *PACKAGE.glob("*/*")]
        if path.name not in ("__init__.py", "__pycache__") and (path.is_dir() or path.suffix in (".py", ".md"))
    }
    assert listed == found, (
        f"missing from docs/layout.md: {sorted(found - listed)}; not in the tree: {sorted(listed - found)}"
    )


def test_only_integration_and_the_bundled_model_change_transformers():
    """transformers_internals' writes are called from integration (the three seams, the attention name) and the
    bundled model (its GGUF quantizer) only."""
    writes = {"set_cache_implementations", "set_prepare_cache_method", "remove_attention", "drop_quantizer"}
    callers = {
        file.relative_to(PACKAGE).as_posix()
        for file in PACKAGE.rglob("*.py")
        if file.name != "transformers_internals.py"
        for node in ast.walk(ast.parse(file.read_text()))
        if isinstance(node, ast.Name | ast.Attribute) and getattr(node, "id", getattr(node, "attr", None)) in writes
    }
    assert callers == {"integration/seams.py", "bundled/model.py"}


def test_only_the_memory_package_takes_a_pools_lock():
    """Outside ``memory`` a change of several steps holds the pool through ``pool.pages.held()``, never its lock."""
    takers = {
        file.relative_to(PACKAGE).as_posix()
        for file in PACKAGE.rglob("*.py")
        if file.relative_to(PACKAGE).parts[0] != "memory"
        for node in ast.walk(ast.parse(file.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "lock" and "pool" in ast.unparse(node.value).lower()
    }
    assert takers == set()
