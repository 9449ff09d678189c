"""A model's config.json, the estimate's one input about the model: found without its weights.

    model_config(model)          config.json as a dict: the demo's tiny model, a local folder, or a
                                 hub id's (from the Hugging Face cache, fetched into it once)
    reward_model_configs(job)    the config.json of each reward model the job names
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo_run.runner.home import ensure_model, is_tiny
from grpo_run.runner.spec.job import TrainingJob

__all__ = ["SHIPPED_CONFIGS", "fill_cache_hint", "model_config", "reward_model_configs"]


def model_config(model: str, *, cache_dir: str | Path | None = None) -> dict[str, Any]:
    """The model's config.json as a dict, without weights.

    - `tiny:NAME`: the built-in demo model, built on first use under $GRPO_RUN_HOME/models/;
    - a local folder: its config.json (a folder holding only config.json is enough);
    - a hub id such as `Qwen/Qwen3-8B`: its config.json from the Hugging Face cache (`cache_dir`,
      default the usual HF_HUB_CACHE); when it is not there, that one file (a few kB) is fetched
      into the cache through huggingface_hub, the way the trainer will find it, so the job keeps
      its hub id and every node downloads the weights itself. HF_HUB_OFFLINE=1 is honoured. The
      cache's raw file is read rather than `AutoConfig`'s object, so an architecture this
      transformers does not know is still estimated, and the three sources give the same dict.

    Raises LookupError when the config cannot be found or fetched, saying how to provide it
    without changing spec.model; ValueError when a config.json is not a JSON object.
    """
    if is_tiny(model):
        return _read_config(Path(ensure_model(model)) / "config.json")
    folder = Path(model).expanduser()
    if folder.is_dir():
        path = folder / "config.json"
        if not path.is_file():
            raise LookupError(f"{folder} has no config.json: point spec.model at the folder "
                              "`save_pretrained` wrote (only config.json is needed for the estimate)")
        return _read_config(path)
    if folder.exists() or model.startswith(("/", "./", "../", "~")):
        raise LookupError(f"spec.model: {model} is not a folder; give a folder holding the "
                          "model's config.json")
    path = _cached_hub_config(model, cache_dir) or _fetch_hub_config(model, cache_dir)
    return _read_config(Path(path))


# Hub models whose config.json a checkout ships under examples/ (a dry run offline; not in the wheel)
SHIPPED_CONFIGS = {"Qwen/Qwen2.5-0.5B-Instruct": "qwen2.5-0.5b-instruct-config", "Qwen/Qwen3-8B": "qwen3-8b-config"}


def fill_cache_hint(repo_id: str) -> str:
    """How to put a hub model's config.json into the Hugging Face cache by hand, spec.model
    unchanged; and, for a model whose config this checkout ships, how to dry-run it offline."""
    hint = (f"fill the cache on a machine with network: `hf download {repo_id} config.json` (or python -c "
            f"\"from huggingface_hub import hf_hub_download; hf_hub_download('{repo_id}', 'config.json')\"), "
            f"then run this again; keep spec.model: {repo_id} (each node downloads the weights itself)")
    shipped = Path(__file__).resolve().parents[2] / "examples" / SHIPPED_CONFIGS.get(repo_id, "-")
    if (shipped / "config.json").is_file():
        hint += (f"; for a dry run alone, offline, spec.model: {shipped} (its config.json, shipped with this "
                 f"checkout) gives the same estimate")
    return hint


def _fetch_hub_config(repo_id: str, cache_dir: str | Path | None) -> str:
    """config.json of `repo_id` fetched into the Hugging Face cache (only that file). Raises
    LookupError saying why it could not be and how to fill the cache instead."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.errors import EntryNotFoundError, GatedRepoError, HFValidationError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    where = f"spec.model: no config.json for {repo_id!r} in the Hugging Face cache"
    try:
        validate_repo_id(repo_id)           # before the network: a typo is not an outage
    except HFValidationError:
        raise LookupError(f"spec.model: {repo_id!r} is neither a local folder nor a Hugging Face hub id "
                          "(owner/name, e.g. Qwen/Qwen2.5-0.5B-Instruct): give a folder holding config.json, "
                          "or a hub id") from None
    if constants.HF_HUB_OFFLINE:
        raise LookupError(f"{where}, and HF_HUB_OFFLINE is set, so it is not fetched: {fill_cache_hint(repo_id)}")
    try:
        # one HEAD first, without huggingface_hub's retries (five, 23 s of backoff, a warning each):
        # a machine without network hears so at once
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json"))
        return hf_hub_download(repo_id, "config.json", cache_dir=str(cache_dir) if cache_dir else None)
    except GatedRepoError:
        raise LookupError(f"spec.model: {repo_id!r} is gated on the Hugging Face hub: accept its terms on "
                          f"https://huggingface.co/{repo_id} and log in (`hf auth login`, or HF_TOKEN), then "
                          "run this again") from None
    except RepositoryNotFoundError:
        raise LookupError(f"spec.model: no model {repo_id!r} on the Hugging Face hub (or it is private and "
                          "you are not logged in: `hf auth login`, or HF_TOKEN): check the id, e.g. "
                          "Qwen/Qwen2.5-0.5B-Instruct, or give a local folder") from None
    except EntryNotFoundError as e:
        if not isinstance(e, FileNotFoundError):          # the hub answered: the repository has no config.json
            raise LookupError(f"spec.model: {repo_id!r} has no config.json on the Hugging Face hub: give a "
                              "transformers model (a repository `save_pretrained` wrote)") from None
        raise LookupError(f"{where}, and the hub could not be reached to fetch it ({_first_line(e)}): "
                          f"{fill_cache_hint(repo_id)}") from None
    except Exception as e:       # no network (httpx's errors), a proxy, the hub down: all said the same way
        raise LookupError(f"{where}, and fetching it failed ({_first_line(e)}): {fill_cache_hint(repo_id)}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]


def _cached_hub_config(repo_id: str, cache_dir: str | Path | None) -> str | None:
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json",
                                       cache_dir=str(cache_dir) if cache_dir else None)
    except ValueError:  # not a valid repo id (e.g. "a/b/c"): it cannot be in the cache either
        return None
    return found if isinstance(found, str) else None  # None, or _CACHED_NO_EXIST


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: must be a JSON object like the one `save_pretrained` writes")
    return config


def reward_model_configs(job: TrainingJob) -> list[dict[str, Any]]:
    """The config.json of each reward model the job names (spec.environment.rewards[].model), found
    as model_config finds the policy's. Raises LookupError or ValueError naming the reward."""
    configs = []
    for i, reward in enumerate(job.environment.rewards):
        if reward.model is None:
            continue
        field = f"spec.environment.rewards[{i}].model"
        try:
            config = model_config(reward.model)
        except (LookupError, ValueError) as e:
            raise type(e)(f"{field}: {str(e).removeprefix('spec.model: ')}".replace("spec.model", field)) from None
        outputs = config.get("num_labels", len(config.get("id2label") or {}) or 2)   # transformers' default: 2
        if outputs != 1:
            raise ValueError(f"{field}: {reward.model} has {outputs} outputs (num_labels); a reward model is a "
                             "sequence classifier with one logit, the reward (num_labels: 1 in its config.json)")
        configs.append(config)
    return configs
