"""Generates with the bundled SmolLM2 through PagedCache and DynamicCache; prints both and the pool's statistics.

Usage: python scripts/demo.py [--max-new-tokens 40] [--max-tokens 4096]
"""

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import hf_kvcache  # noqa: E402
from hf_kvcache.bundled import load_bundled_model  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about a lighthouse keeper.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=4096, help="token budget of the demo's fixed pool")
    args = parser.parse_args()

    model, tokenizer = load_bundled_model()
    chats = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
    texts = [tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) for chat in chats]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    pool = hf_kvcache.KVPool.for_model(model, max_tokens=args.max_tokens, name="demo")
    settings = {"max_new_tokens": args.max_new_tokens, "do_sample": False}

    with torch.inference_mode():
        started = time.perf_counter()
        dynamic = model.generate(**batch, **settings)
        dynamic_seconds = time.perf_counter() - started
        started = time.perf_counter()
        out = model.generate(
            **batch,
            **settings,
            cache_implementation="paged_pool",
            cache_config={"pool": "demo"},
            return_dict_in_generate=True,
        )
        paged_seconds = time.perf_counter() - started
        in_use = pool.stats()

    width = batch.input_ids.shape[1]
    for prompt, reference, paged in zip(PROMPTS, dynamic, out.sequences, strict=True):
        print(f"\n### {prompt}")
        print(f"DynamicCache : {tokenizer.decode(reference[width:], skip_special_tokens=True)!r}")
        print(f"paged_pool   : {tokenizer.decode(paged[width:], skip_special_tokens=True)!r}")
        print(f"identical    : {torch.equal(reference, paged)}")
    print(f"\nDynamicCache {dynamic_seconds:.2f} s, paged_pool {paged_seconds:.2f} s")
    print("\nPool while the paged cache is alive:")
    for key in (
        "pages_total",
        "pages_used",
        "pages_free",
        "high_water_pages",
        "tokens_held",
        "utilization",
        "bytes_used",
        "bytes_total",
    ):
        print(f"  {key:17s} {in_use[key]:.3f}" if key == "utilization" else f"  {key:17s} {in_use[key]}")
    del out
    print(f"  after release     pages_used={pool.stats()['pages_used']}")


if __name__ == "__main__":
    main()
