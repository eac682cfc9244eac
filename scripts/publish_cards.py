"""Renders the model cards of our cache settings from eval reports, validates them, and publishes them to the Hub.

Examples:
    python scripts/publish_cards.py model_cards/results/smollm2-135m-essays/report.json --dry-run
    python scripts/publish_cards.py model_cards/results/smollm2-135m-essays/report.json --namespace my-org

Each card goes to ``<output-dir>/<model>-<cache>/`` and, unless ``--dry-run``, to the Hub model repo
``<namespace>/<model>-<cache>``. Settings whose cache is not registered, or whose label is not in a report,
are skipped with a message (see ``hf_kvcache.cards.settings.CARD_SETTINGS``).
"""

import argparse
import os
import sys
from pathlib import Path

from hf_kvcache.cards.publish import check_can_publish, publish_card
from hf_kvcache.cards.render import render_card
from hf_kvcache.cards.settings import plan_cards
from hf_kvcache.cards.validate import validate_card
from hf_kvcache.eval import EvalReport, reproduce_command

REPO_ROOT = Path(__file__).resolve().parents[1]
NAMESPACE_PLACEHOLDER = "<namespace>"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("reports", nargs="+", type=Path, help="report.json files written by evaluate_caches.py")
    parser.add_argument("--namespace", help="Hub user or organization the repos go to (needed unless --dry-run)")
    parser.add_argument("--output-dir", type=Path, default=REPO_ROOT / "model_cards", help="where card folders go")
    parser.add_argument("--dry-run", action="store_true", help="write and validate the cards; upload nothing")
    args = parser.parse_args(argv)
    if not args.dry_run and not args.namespace:
        parser.error("--namespace is required to publish; pass --dry-run to only write and validate the cards.")
    token = None
    if not args.dry_run:
        try:
            token = check_can_publish()
        except RuntimeError as error:
            sys.exit(f"publish_cards: {error}")

    cards: dict[str, tuple[str, Path]] = {}  # folder name -> (repo id, folder)
    for path in args.reports:
        report = EvalReport.load(path)
        command = reproduce_command(report, output=_relative_to_repo(path.parent))
        ready, skipped = plan_cards(report)
        for message in skipped:
            print(f"{path}: {message}")
        for setting in ready:
            if setting.folder_name in cards:
                print(f"{path}: skip {setting.folder_name}: already rendered from an earlier report.")
                continue
            repo_id = f"{args.namespace or NAMESPACE_PLACEHOLDER}/{setting.folder_name}"
            folder = render_card(setting, report, args.output_dir, command, repo_id)
            validate_card(folder)
            cards[setting.folder_name] = (repo_id, folder)
            print(f"{path}: wrote and validated {folder}")
    if token is None:
        return
    for repo_id, folder in cards.values():
        print(f"published {folder} to {publish_card(folder, repo_id, token)}")


def _relative_to_repo(folder: Path) -> str:
    """The folder as the card's command should name it: relative to the checkout when it lies inside it."""
    resolved = folder.resolve()
    return os.path.relpath(resolved, REPO_ROOT) if resolved.is_relative_to(REPO_ROOT) else str(resolved)


if __name__ == "__main__":
    main()
