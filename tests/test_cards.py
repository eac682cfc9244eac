"""Model-card folders: rendered from the eval JSON, loadable by transformers, valid for the Hub, publishable.

Offline throughout: custom_generate runs from local folders, and publishing goes to a stand-in for ``HfApi``.
"""

import copy
import dataclasses
import importlib.util
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig

import hf_kvcache
from hf_kvcache.bundled import BUNDLED_MODEL
from hf_kvcache.cards import generate_with_cache, publish
from hf_kvcache.cards.render import REPOSITORY, render_card
from hf_kvcache.cards.settings import CARD_SETTINGS, plan_cards
from hf_kvcache.cards.validate import validate_card
from hf_kvcache.eval.caches import CacheSpec
from hf_kvcache.eval.command import reproduce_command
from hf_kvcache.eval.report import EvalReport
from hf_kvcache.eval.runner import EvalConfig
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.testing import tiny_llama

ROOT = Path(__file__).parents[1]
REPORT = ROOT / "model_cards" / "results" / "smollm2-135m-essays-2048" / "report.json"
REGISTERED = [setting for setting in CARD_SETTINGS if setting.cache_implementation in REGISTRY]
IDS = [setting.cache_implementation for setting in REGISTERED]
PROMPT = torch.tensor([[1, 5, 9, 3, 7, 11], [4, 8, 15, 16, 23, 42]])


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"_script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def card_model():
    """A tiny Llama with the bundled model's head size (64), so every card's cache_config applies as published."""
    return tiny_llama(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)


@pytest.fixture(scope="module")
def report_path(tmp_path_factory) -> Path:
    """The real report, plus (for settings registered since it was written) a copy of the paged_pool result
    under the setting's label, so that every registered card is rendered and tested the day it is registered."""
    raw = json.loads(REPORT.read_text())
    labels = {result["label"] for result in raw["caches"]}
    template = next(result for result in raw["caches"] if result["label"] == "paged_pool")
    for setting in REGISTERED:
        if setting.result_label not in labels:
            extra = copy.deepcopy(template)
            extra.update(label=setting.result_label, kind=setting.cache_implementation, settings=setting.cache_config)
            raw["caches"].append(extra)
    path = tmp_path_factory.mktemp("report") / "report.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.fixture(scope="module")
def rendered(report_path, tmp_path_factory) -> dict[str, Path]:
    """Card folder of every registered setting, by cache name."""
    report = EvalReport.load(report_path)
    ready, _ = plan_cards(report)
    root = tmp_path_factory.mktemp("cards")
    command = reproduce_command(report, output="results")
    return {s.cache_implementation: render_card(s, report, root, command, f"me/{s.folder_name}") for s in ready}


def test_plan_renders_registered_settings_in_the_report_and_skips_the_rest():
    report = EvalReport.load(REPORT)
    ready, skipped = plan_cards(report)
    labels = {result.label for result in report.caches}
    assert ready == [s for s in REGISTERED if s.result_label in labels]
    assert any(s.cache_implementation == "paged_pool" for s in ready)
    assert len(ready) + len(skipped) == len(CARD_SETTINGS)
    for setting in [setting for setting in CARD_SETTINGS if setting not in ready]:
        (message,) = [m for m in skipped if setting.folder_name in m]
        assert "not registered" in message or f"--cache {setting.eval_spec}" in message


@pytest.mark.parametrize("setting", REGISTERED, ids=IDS)
def test_generation_config_loads_with_the_setting(rendered, setting):
    config = GenerationConfig.from_pretrained(rendered[setting.cache_implementation])
    assert (config.cache_implementation, config.cache_config) == (setting.cache_implementation, setting.cache_config)


@pytest.mark.parametrize("setting", REGISTERED, ids=IDS)
def test_card_validates_with_hub_metadata(rendered, setting):
    card = validate_card(rendered[setting.cache_implementation])
    assert card.data.base_model == setting.model.hub_id
    assert card.data.license == setting.model.license == "apache-2.0"
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert f'custom_generate="me/{setting.folder_name}"' in card.text


def test_card_pins_the_version_it_was_rendered_with_and_says_how_to_install_it(rendered):
    folder = rendered["paged_pool"]
    requirements = (folder / "custom_generate" / "requirements.txt").read_text().splitlines()
    assert f"hf_kvcache=={hf_kvcache.__version__}" in requirements
    install = f'pip install "hf_kvcache @ git+{REPOSITORY}@v{hf_kvcache.__version__}"'
    assert any(line.startswith("#") and install in line for line in requirements)  # transformers skips comments
    use = (folder / "README.md").read_text().split("## Use")[1]
    assert f"`hf_kvcache=={hf_kvcache.__version__}`" in use and install in use
    assert "`#" not in use  # the comment line is not listed as a requirement


def test_committed_cards_pin_this_version():
    """model_cards/ is rendered by ``scripts/publish_cards.py --dry-run``: rerender it when the version changes."""
    for requirements in sorted(ROOT.glob("model_cards/*/custom_generate/requirements.txt")):
        assert f"hf_kvcache=={hf_kvcache.__version__}" in requirements.read_text().splitlines(), requirements


@pytest.mark.parametrize("setting", REGISTERED, ids=IDS)
def test_custom_generate_folder_generates_with_our_cache(card_model, rendered, setting):
    folder = str(rendered[setting.cache_implementation])
    common = {"max_new_tokens": 8, "do_sample": False, "return_dict_in_generate": True}
    out = card_model.generate(input_ids=PROMPT, custom_generate=folder, trust_remote_code=True, **common)
    direct = card_model.generate(
        PROMPT, cache_implementation=setting.cache_implementation, cache_config=setting.cache_config, **common
    )
    assert isinstance(out.cache, REGISTRY[setting.cache_implementation].cache_class)
    assert torch.equal(out.sequences, direct.sequences)


@pytest.mark.parametrize("setting", REGISTERED, ids=IDS)
def test_model_folder_with_custom_generate_uses_our_cache(card_model, rendered, setting, tmp_path):
    """A repo holding weights and the card's custom_generate: generate is replaced on from_pretrained."""
    card_model.save_pretrained(tmp_path)
    shutil.copytree(rendered[setting.cache_implementation] / "custom_generate", tmp_path / "custom_generate")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    out = model.generate(PROMPT, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)  # positional
    direct = card_model.generate(
        PROMPT,
        max_new_tokens=8,
        do_sample=False,
        cache_implementation=setting.cache_implementation,
        cache_config=setting.cache_config,
    )
    assert isinstance(out.cache, REGISTRY[setting.cache_implementation].cache_class)
    assert torch.equal(out.sequences, direct)


def test_caller_can_override_the_cards_cache(card_model, rendered):
    folder = str(rendered["paged_pool"])
    kwargs = {"max_new_tokens": 4, "return_dict_in_generate": True, "custom_generate": folder}
    out = card_model.generate(input_ids=PROMPT, cache_implementation="dynamic", trust_remote_code=True, **kwargs)
    assert type(out.cache) is DynamicCache
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        card_model.generate(input_ids=PROMPT, trust_remote_code=False, **kwargs)


def test_unregistered_cache_is_rejected_clearly(card_model, rendered, tmp_path):
    folder = shutil.copytree(rendered["paged_pool"], tmp_path / "card")
    saved = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**saved, "cache_implementation": "no_such_cache"}))
    with pytest.raises(ValueError, match=r"'no_such_cache' is not a cache registered by hf_kvcache .*registered: \["):
        validate_card(folder)
    with pytest.raises(ValueError, match="'no_such_cache' is not a cache registered"):
        generate_with_cache(card_model, "no_such_cache", {}, {"input_ids": PROMPT})
    hf_kvcache.unregister()
    try:
        with pytest.raises(ValueError, match=r"registered: none; call hf_kvcache.register\(\)"):
            validate_card(rendered["paged_pool"])
    finally:
        hf_kvcache.register()


def test_card_with_a_missing_file_or_field_is_rejected(rendered, tmp_path):
    folder = shutil.copytree(rendered["paged_pool"], tmp_path / "card")
    readme = (folder / "README.md").read_text()
    (folder / "README.md").write_text(readme.replace("library_name: transformers\n", ""))
    with pytest.raises(ValueError, match="library_name must be 'transformers'"):
        validate_card(folder)
    (folder / "custom_generate" / "requirements.txt").unlink()
    with pytest.raises(ValueError, match=r"lacks \['custom_generate/requirements.txt'\]"):
        validate_card(folder)


def test_render_refuses_a_result_measured_with_other_settings(tmp_path):
    raw = json.loads(REPORT.read_text())
    next(result for result in raw["caches"] if result["label"] == "paged_pool")["settings"] = {"page_size": 8}
    (tmp_path / "report.json").write_text(json.dumps(raw))
    report = EvalReport.load(tmp_path / "report.json")
    setting = next(setting for setting in CARD_SETTINGS if setting.result_label == "paged_pool")
    with pytest.raises(ValueError, match=r"measured paged_pool with \{'page_size': 8\}.*--cache paged_pool"):
        render_card(setting, report, tmp_path, "command", "me/card")


# Card table column -> its number in a report result (percentages as the card prints them).
EXPECTED = {
    "perplexity": lambda r, b: r["perplexity"],
    "perplexity vs baseline": lambda r, b: 100 * r["perplexity_change_relative"],
    "KL vs baseline (nats)": lambda r, b: r["kl_mean"],
    "top-1 agreement": lambda r, b: 100 * r["top1_agreement"],
    "retrieval accuracy": lambda r, b: 100 * r["retrieval"]["accuracy"],
    "KV bytes/token held": lambda r, b: r["kv_bytes_per_token"],
    "KV memory held vs baseline": lambda r, b: (
        100 * (r["kv_bytes_held"] / b["kv_bytes_held"] - 1)
        if r.get("kv_bytes_held") is not None and b.get("kv_bytes_held") is not None
        else 100 * (r["kv_bytes_per_token"] / b["kv_bytes_per_token"] - 1)
    ),
}


def parse_number(cell: str) -> tuple[float, float]:
    """A printed number and half a unit of its last printed digit (the most rounding can have moved it)."""
    text = cell.replace(",", "").rstrip("%")
    mantissa, _, exponent = text.partition("e")
    decimals = len(mantissa.partition(".")[2])
    return float(text), 0.5 * 10.0 ** (int(exponent or 0) - decimals) + 1e-12


@pytest.mark.parametrize("source", ["rendered", "committed"])
def test_card_table_is_the_json(rendered, report_path, source):
    folder = (
        rendered["paged_pool"] if source == "rendered" else ROOT / "model_cards" / "smollm2-135m-instruct-paged_pool"
    )
    raw = json.loads((report_path if source == "rendered" else REPORT).read_text())
    results = {result["label"]: result for result in raw["caches"]}
    section = (folder / "README.md").read_text().split("## Quality and memory")[1].split("\n## ")[0]
    header, _, *rows = [line.strip("|").split(" | ") for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in header]
    assert header[0] == "cache" and set(header[1:]) <= set(EXPECTED), header
    labels = [re.sub(r" \(baseline\)$", "", row[0].strip()) for row in rows]
    assert labels == ["dynamic", "paged_pool"] and rows[0][0].strip().endswith("(baseline)")
    for label, row in zip(labels, rows):
        for column, cell in zip(header[1:], row[1:]):
            value, tolerance = parse_number(cell.strip())
            assert value == pytest.approx(EXPECTED[column](results[label], results["dynamic"]), abs=tolerance), column
    if source == "committed":
        validate_card(folder)


def test_card_states_the_length_it_was_measured_at_and_the_change_by_position(rendered, report_path):
    raw = json.loads(report_path.read_text())
    results = {result["label"]: result for result in raw["caches"]}
    result, baseline = results["paged_pool"], results["dynamic"]
    section = (rendered["paged_pool"] / "README.md").read_text().split("## Quality by length")[1].split("\n## ")[0]
    assert f"documents of {raw['config']['document_tokens']:,} tokens each" in section
    edges = result["bucket_edges"]
    assert "| positions | " + " | ".join(f"{a}–{b}" for a, b in zip(edges, edges[1:])) + " |" in section
    row = next(line for line in section.splitlines() if line.startswith("| perplexity vs baseline"))
    printed = [parse_number(cell.strip()) for cell in row.strip("|").split(" | ")[1:]]
    by_bucket = zip(result["perplexity_by_bucket"], baseline["perplexity_by_bucket"])
    expected = [100 * (ppl / base - 1) for ppl, base in by_bucket]
    assert len(printed) == len(expected)
    for (value, tolerance), want in zip(printed, expected):
        assert value == pytest.approx(want, abs=tolerance)


def test_reproduce_command_is_the_reports_configuration(monkeypatch):
    """The card's command, fed to the eval script, builds exactly the report's EvalConfig."""
    report = EvalReport.load(REPORT)
    command = reproduce_command(report, output="model_cards/results/smollm2-135m-essays")
    words = shlex.split(command.replace("\\\n", " "))
    assert words[:2] == ["python", "scripts/evaluate_caches.py"]
    script = load_script("evaluate_caches")
    captured = []

    def stop(config):
        captured.append(config)
        raise KeyboardInterrupt

    monkeypatch.setattr(script, "run_evaluation", stop)
    with pytest.raises(KeyboardInterrupt):
        script.main(words[2:])
    config = dataclasses.asdict(captured[0])
    assert config.pop("model") == "bundled" and report.config["model"] == BUNDLED_MODEL
    for key, value in config.items():
        expected = report.config.get(key, getattr(EvalConfig(), key))
        if key == "specs":  # published reports predate a spec's attention: they ran the model's
            value, expected = ([CacheSpec(**spec) for spec in specs] for specs in (value, expected))
        if key != "progress":  # published reports predate attn_implementation: they ran the default
            assert value == expected, key
    assert words[words.index("--output") + 1] == "model_cards/results/smollm2-135m-essays"
    recorded = dataclasses.replace(report, config={**report.config, "command": "python run.py"})
    assert reproduce_command(recorded, output="elsewhere") == "python run.py"  # a recorded command wins


def test_publish_dry_run_writes_and_validates(tmp_path, capsys):
    load_script("publish_cards").main([str(REPORT), "--dry-run", "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    validate_card(tmp_path / "smollm2-135m-instruct-paged_pool")
    assert "wrote and validated" in out
    for setting in CARD_SETTINGS:
        if setting.cache_implementation not in REGISTRY:
            assert f"skip {setting.folder_name}: cache {setting.cache_implementation!r} is not registered" in out


class FakeApi:
    """Stands in for HfApi: records what would be sent."""

    calls: list[tuple[str, dict]] = []

    def __init__(self, token: str) -> None:
        self.calls.append(("token", {"token": token}))

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))
        return type("Commit", (), {"commit_url": f"https://huggingface.co/{kwargs['repo_id']}/commit/0"})()


def test_publish_refuses_offline_and_without_a_token(monkeypatch, tmp_path):
    script = load_script("publish_cards")
    argv = [str(REPORT), "--namespace", "me", "--output-dir", str(tmp_path)]
    monkeypatch.setattr(publish, "HfApi", None)  # any network call would fail
    monkeypatch.setattr(publish, "is_offline_mode", lambda: True)
    with pytest.raises(SystemExit, match="HF_HUB_OFFLINE is set.*--dry-run"):
        script.main(argv)
    monkeypatch.setattr(publish, "is_offline_mode", lambda: False)
    monkeypatch.setattr(publish, "get_token", lambda: None)
    with pytest.raises(SystemExit, match="No Hugging Face token: run `hf auth login` or set HF_TOKEN"):
        script.main(argv)
    assert not any(tmp_path.iterdir())  # refused before writing anything
    with pytest.raises(SystemExit):
        script.main([str(REPORT), "--output-dir", str(tmp_path)])  # neither --namespace nor --dry-run


def test_publish_uploads_each_validated_folder(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(publish, "is_offline_mode", lambda: False)
    monkeypatch.setattr(publish, "get_token", lambda: "hf_test")
    monkeypatch.setattr(publish, "HfApi", FakeApi)
    FakeApi.calls.clear()
    load_script("publish_cards").main([str(REPORT), "--namespace", "me", "--output-dir", str(tmp_path)])
    folder = tmp_path / "smollm2-135m-instruct-paged_pool"
    repo_id = "me/smollm2-135m-instruct-paged_pool"
    assert ("create_repo", {"repo_id": repo_id, "repo_type": "model", "exist_ok": True}) in FakeApi.calls
    uploads = [kwargs for name, kwargs in FakeApi.calls if name == "upload_folder"]
    assert len(uploads) == len(list(tmp_path.iterdir()))  # every rendered folder, once
    (upload,) = [kwargs for kwargs in uploads if kwargs["repo_id"] == repo_id]
    assert (upload["repo_id"], Path(upload["folder_path"])) == (repo_id, folder)
    assert f'GenerationConfig.from_pretrained("{repo_id}")' in (folder / "README.md").read_text()
    assert f"https://huggingface.co/{repo_id}/commit/0" in capsys.readouterr().out
