"""Checks a built wheel: what it holds, and that it generates with every registered cache when installed alone.

Examples (``.ci/run`` runs both):
    python scripts/check_wheel.py contents dist/hf_kvcache-0.1.0-py3-none-any.whl
    cd /tmp && HF_HUB_OFFLINE=1 /path/to/fresh-venv/bin/python /path/to/scripts/check_wheel.py generate

``contents`` needs only the standard library: every file of the wheel lies under ``hf_kvcache/`` or its
``.dist-info``, the package's data is there (``py.typed``, the card template, the fidelity metric module), and no
test, benchmark, card, script or doc slipped in. ``generate`` runs in a virtual environment where the wheel was
installed with its core dependencies only, from outside the checkout: ``import hf_kvcache`` comes from that
environment, no extra's package is installed, a tool names its extra, and ``generate(cache_implementation=NAME)``
runs for every registered name on tiny random models (a full-attention Llama and a hybrid Gemma 3), offline; where
a cache keeps every token exactly, its greedy tokens equal ``DynamicCache``'s.
"""

import argparse
import importlib.util
import sys
import zipfile
from pathlib import Path

PACKAGE = "hf_kvcache"
REQUIRED_DATA = ("py.typed", "cards/card_template.md", "eval/metrics/kv_cache_fidelity/kv_cache_fidelity.py")
"""Package data the wheel must carry (``[tool.setuptools.package-data]``)."""
EXTRA_PACKAGES = ("datasets", "evaluate", "gguf", "matplotlib", "psutil", "optimum", "hqq", "peft", "accelerate")
"""What the extras install and the core must not need."""
EXACT = {"paged_pool"}
"""Registered caches that keep every token unchanged: greedy tokens equal DynamicCache's."""


def check_contents(wheel: Path) -> list[str]:
    """Checks the wheel's file list; returns it.

    Raises:
        SystemExit: a file outside the package or its metadata, or package data missing.
    """
    with zipfile.ZipFile(wheel) as archive:
        names = sorted(archive.namelist())
    dist_info = next((name.split("/")[0] for name in names if name.split("/")[0].endswith(".dist-info")), None)
    stray = [name for name in names if name.split("/")[0] not in (PACKAGE, dist_info)]
    missing = [data for data in REQUIRED_DATA if f"{PACKAGE}/{data}" not in names]
    unwanted = [
        name
        for name in names
        if any(part in ("tests", "benchmarks", "model_cards", "scripts", "docs") for part in name.split("/")[:-1])
    ]
    licensed = any(name.startswith(f"{dist_info}/licenses/LICENSE") for name in names)
    problems = [f"outside {PACKAGE}/ and {dist_info}/: {stray}"] * bool(stray)
    problems += [f"package data missing: {missing}"] * bool(missing)
    problems += [f"not package code: {unwanted}"] * bool(unwanted)
    problems += ["no LICENSE in the metadata"] * (not licensed)
    if problems:
        sys.exit(f"{wheel.name}: " + "; ".join(problems))
    return names


def check_generate() -> None:
    """Generates with every registered cache from the installed wheel alone; prints one line per cache and model."""
    import torch
    from transformers import DynamicCache

    import hf_kvcache
    from hf_kvcache.errors import MissingExtraError
    from hf_kvcache.integration.registry import REGISTRY
    from hf_kvcache.testing import tiny_gemma3, tiny_llama

    here = Path(hf_kvcache.__file__).resolve()
    if "site-packages" not in here.parts:
        sys.exit(f"hf_kvcache was imported from {here}, not from an installed wheel: run this outside the checkout")
    installed = [name for name in EXTRA_PACKAGES if importlib.util.find_spec(name) is not None]
    if installed:
        sys.exit(f"an extra's packages are installed here: {installed}; this check needs the core dependencies only")
    try:
        import hf_kvcache.eval  # noqa: F401
    except MissingExtraError as error:
        print(f"import hf_kvcache.eval without the extra: {error}")
    else:
        sys.exit("hf_kvcache.eval imported without its extra's packages")
    print(f"hf_kvcache {hf_kvcache.__version__} from {here.parent}, torch {torch.__version__}")

    prompt = torch.tensor([[1, 5, 9, 3, 7, 11, 4, 8], [1, 4, 8, 15, 16, 23, 42, 6]])  # [batch, prompt_tokens]
    for model_name, model in (("tiny_llama", tiny_llama()), ("tiny_gemma3", tiny_gemma3())):
        settings = {"max_new_tokens": 24, "do_sample": False}
        expected = model.generate(prompt, cache=DynamicCache(config=model.config), **settings)
        for name, entry in REGISTRY.items():
            config = dict(entry.example_config)
            out = model.generate(prompt, cache_implementation=name, cache_config=config, **settings)
            if out.shape != expected.shape:
                sys.exit(f"{name} on {model_name}: output {tuple(out.shape)}, expected {tuple(expected.shape)}")
            same = torch.equal(out, expected)
            if name in EXACT and not same:
                sys.exit(f"{name} on {model_name}: greedy tokens differ from DynamicCache's")
            print(
                f"{model_name:12} {name:17} cache_config={config}: {tuple(out.shape)}, tokens equal DynamicCache's: "
                f"{same}"
            )
    print("wheel check: every registered cache generates with the core dependencies only")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    contents = commands.add_parser("contents", help="check the files a wheel holds")
    contents.add_argument("wheel", type=Path)
    commands.add_parser("generate", help="generate with every cache from the installed wheel (core only)")
    args = parser.parse_args(argv)
    if args.command == "contents":
        names = check_contents(args.wheel)
        print(f"{args.wheel.name}: {len(names)} files, only {PACKAGE}/ and its metadata:")
        print("\n".join(f"  {name}" for name in names))
    else:
        check_generate()


if __name__ == "__main__":
    main()
