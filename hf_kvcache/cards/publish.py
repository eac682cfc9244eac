"""Publishing card folders to the Hugging Face Hub (refused offline or without a token, saying why)."""

from pathlib import Path

from huggingface_hub import HfApi, get_token, is_offline_mode

from hf_kvcache import __version__


def check_can_publish() -> str:
    """Returns the Hugging Face token to publish with.

    Raises:
        RuntimeError: offline mode is on, or no token is set; the message says what to do.
    """
    if is_offline_mode():
        raise RuntimeError(
            "HF_HUB_OFFLINE is set, so nothing can be uploaded: unset HF_HUB_OFFLINE (and TRANSFORMERS_OFFLINE) "
            "on a machine that reaches huggingface.co, or pass --dry-run to only write and validate the cards."
        )
    token = get_token()
    if token is None:
        raise RuntimeError(
            "No Hugging Face token: run `hf auth login` or set HF_TOKEN to a token with write access to the "
            "namespace, or pass --dry-run to only write and validate the cards."
        )
    return token


def publish_card(folder: str | Path, repo_id: str, token: str) -> str:
    """Creates the model repo ``repo_id`` if needed and uploads the card folder; returns the commit URL."""
    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", exist_ok=True)
    commit = api.upload_folder(
        folder_path=folder,
        repo_id=repo_id,
        repo_type="model",
        commit_message=f"Card {Path(folder).name} (hf_kvcache {__version__})",
    )
    return commit.commit_url
