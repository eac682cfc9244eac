"""What ``pip install hf_kvcache`` installs is what the code imports: every third-party module imported at load time
is a declared dependency, and what only an extra provides is imported where it is used, with a clear message."""

import ast
import importlib.metadata
import logging
import re
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from hf_kvcache.eval.report import CacheResult, EvalReport

ROOT = Path(__file__).parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirement_names(requirements: list[str]) -> set[str]:
    return {
        re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-") for requirement in requirements
    }


def imported_distributions(load_time: bool) -> set[str]:
    """Distributions whose modules ``hf_kvcache`` imports at module level (``load_time``) or inside functions."""
    names = set()
    for path in (ROOT / "hf_kvcache").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules = [node.module]
            else:
                continue
            if (node.col_offset == 0) != load_time:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top == "hf_kvcache":
                    continue
                names |= {name.lower().replace("_", "-") for name in importlib.metadata.packages_distributions()[top]}
    return names


def test_every_module_imported_at_load_time_is_a_dependency():
    missing = imported_distributions(load_time=True) - requirement_names(PYPROJECT["dependencies"])
    assert not missing, f"declare {sorted(missing)} in pyproject.toml's dependencies"


def test_modules_imported_where_used_come_from_an_extra():
    extras = set().union(*(requirement_names(extra) for extra in PYPROJECT["optional-dependencies"].values()))
    optional = imported_distributions(load_time=False) - requirement_names(PYPROJECT["dependencies"])
    assert optional == {"matplotlib"} and optional <= extras
    assert requirement_names(PYPROJECT["optional-dependencies"]["plots"]) == {"matplotlib"}


def test_readme_main_command_installs_the_plots():
    readme = (ROOT / "README.md").read_text()
    main = next(line for line in readme.splitlines() if "scripts/evaluate_caches.py" in line and "pip install" in line)
    assert "plots" in main


def test_a_report_without_matplotlib_keeps_its_table_and_says_how_to_get_the_plots(tmp_path, monkeypatch, caplog):
    result = CacheResult("dynamic", "dynamic", {}, 10.0, 0.0, 0.0, 0.0, 1.0, [10.0], [0, 4], 512.0, 1.0)
    report = EvalReport({"model": "m"}, {}, {"torch": torch.__version__}, 1.0, [result])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ModuleNotFoundError
    with caplog.at_level(logging.WARNING, logger="hf_kvcache.eval"):
        paths = report.save(tmp_path)
    assert set(paths) == {"json", "markdown"} and paths["markdown"].read_text().startswith("| cache |")
    assert "pip install 'hf_kvcache[plots]'" in caplog.text
    with pytest.raises(ModuleNotFoundError):
        report.plot(tmp_path)
