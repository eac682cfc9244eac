"""Every Python block of the README and docs/ runs, so the documentation cannot drift from the code: the README's
quickstart on the bundled model (as a reader runs it offline), the docs' blocks on a tiny model."""

import contextlib
import gc
import io
import re
from pathlib import Path

import pytest
import torch

import hf_kvcache
import hf_kvcache.bundled
from hf_kvcache.testing import tiny_llama

ROOT = Path(__file__).parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.M | re.S)


def run_blocks(blocks: list[str], namespace: dict) -> str:
    """Runs the blocks in order in one namespace, as a reader pastes them; returns what they printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for block in blocks:
            exec(compile(block, "<doc>", "exec"), namespace)
    return printed.getvalue()


def test_readme_quickstart_prints_text_and_the_pools_statistics(bundled, monkeypatch):
    monkeypatch.setattr(hf_kvcache.bundled, "load_bundled_model", lambda: bundled)  # already loaded by the fixture
    namespace = {}
    printed = run_blocks(python_blocks(ROOT / "README.md"), namespace)
    assert printed.startswith("The KV cache of a language model")
    stats = namespace["pool"].stats()
    assert f"'pages_total': {stats['pages_total']}" in printed and stats["pages_total"] == 4096 // stats["page_size"]
    assert stats["high_water_pages"] > 0 and stats["pages_used"] == 0  # every page went back after generate
    assert isinstance(namespace["out"], torch.Tensor)


@pytest.mark.parametrize("doc", [doc for doc in DOCS if python_blocks(doc)], ids=lambda doc: doc.name)
def test_docs_python_blocks_run_on_a_tiny_model(doc):
    model = tiny_llama()
    model.generation_config.max_new_tokens = 6
    ids = torch.tensor([[0, 0, 5, 9, 3, 7], [4, 8, 15, 16, 23, 42]])  # [batch, tokens], the first row left-padded
    namespace = {"hf_kvcache": hf_kvcache, "model": model, "inputs": {"input_ids": ids, "attention_mask": ids != 0}}
    run_blocks(python_blocks(doc), namespace)
    assert namespace["out"].shape[0] == ids.shape[0]
    del namespace  # frees the named pools the blocks made ("serving")
    gc.collect()
