"""Model cards that name the algorithm a model was trained with, its paper and the run's numbers.

TRL's `GRPOTrainer.create_model_card` would say "trained with GRPO" and cite DeepSeekMath for every trainer of this
package (they all subclass it). `VariantTrainer.create_model_card` calls `create_model_card` below instead, so the card
written to `output_dir/README.md` (at every checkpoint, at the end of a CLI run, and by `push_to_hub`, which uploads
`output_dir` as TRL does) names the right algorithm, links and cites its paper, lists the hyperparameters that define
the run and the final metrics, and says it was trained with this package.

Everything but `create_model_card` is pure (no trainer, no network) so the card's content is tested offline.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

from .algorithms import ALGORITHMS, Paper, of_trainer

PACKAGE_NAME = "trl-ppo-variants"


#: algorithm name (as on the command line) -> its paper; the baseline (`grpo`) is TRL's GRPOTrainer, whose own paper
#: (`GRPOTrainer._paper`) its card cites
PAPERS: dict[str, Paper] = {name: a.paper for name, a in ALGORITHMS.items()}

# The fields that define an RL run whatever the algorithm, in the order a reader wants them. Fields declared by this
# package's configs (above `GRPOConfig`) are listed too: they are what distinguishes the algorithm.
_CORE_FIELDS = (
    "learning_rate", "lr_scheduler_type", "warmup_ratio", "warmup_steps", "weight_decay", "max_grad_norm",
    "per_device_train_batch_size", "gradient_accumulation_steps", "num_generations", "generation_batch_size",
    "steps_per_generation", "num_iterations", "max_completion_length", "temperature", "top_p", "top_k",
    "loss_type", "epsilon", "epsilon_high", "beta", "scale_rewards", "reward_weights", "mask_truncated_completions",
    "num_train_epochs", "max_steps", "bf16", "seed", "use_vllm", "vllm_mode",
)

# Final metrics worth a line in the card (the last logged value of each); any `rewards/<name>/mean` is added.
_METRIC_KEYS = (
    "reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio",
    "kl", "kl_in_reward", "entropy", "clip_ratio/region_mean", "value_loss", "loss", "train_loss", "train_runtime",
    "train_steps_per_second",
)


def algorithm_of(trainer_or_cls, args=None) -> str | None:
    """The algorithm name (as on the command line) of a trainer instance or class, or None for the baseline and for
    trainers of other packages (`algorithms.of_trainer`: a user's subclass is its algorithm, and `ReinforcePPTrainer`
    with `args.baseline = True` is REINFORCE++-baseline, a distinct row in the paper)."""
    algorithm = of_trainer(trainer_or_cls, args)
    return algorithm.name if algorithm is not None and not algorithm.baseline else None


def run_hyperparameters(args, num_processes: int = 1) -> dict:
    """The hyperparameters of a run: `_CORE_FIELDS`, then every field this package adds above `GRPOConfig`, then the
    effective batch. `args` is a config instance (any `GRPOConfig` subclass). Of `num_train_epochs` and `max_steps`
    only the one that ends the run is listed (`max_steps > 0` overrides the epochs)."""
    from trl import GRPOConfig

    grpo_fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    ended_by_steps = (getattr(args, "max_steps", -1) or -1) > 0
    out = {}
    for name in _CORE_FIELDS:
        if name == ("num_train_epochs" if ended_by_steps else "max_steps"):
            continue
        if hasattr(args, name):
            out[name] = getattr(args, name)
    for f in dataclasses.fields(args):
        if f.name not in grpo_fields and not f.name.startswith("_"):
            out[f.name] = getattr(args, f.name)
    batch = getattr(args, "per_device_train_batch_size", None)
    accumulation = getattr(args, "gradient_accumulation_steps", None)
    if batch and accumulation:
        out["num_processes"] = num_processes
        out["completions_per_optimizer_step"] = batch * accumulation * num_processes
    return out


def final_metrics(log_history: list[dict]) -> dict:
    """The last logged value of each metric worth reporting, from `trainer.state.log_history`. Non-finite and
    non-numeric values are kept out (a card says what was measured, not NaN placeholders)."""
    last: dict = {}
    for entry in log_history:
        for key, value in entry.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if not math.isfinite(value):
                continue
            last[key] = value
    keys = [k for k in _METRIC_KEYS if k in last]
    keys += sorted(k for k in last if k.startswith("rewards/") and k.endswith("/mean") and k not in keys)
    out = {k: last[k] for k in keys}
    if "step" in last:
        out["global_step"] = int(last["step"])
    return out


def _fmt(value) -> str:
    import enum

    if isinstance(value, enum.Enum):  # TrainingArguments keeps e.g. SchedulerType.LINEAR
        value = value.value
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_model_card(
    algorithm: str | None,
    hyperparameters: dict,
    metrics: dict,
    model_name: str | None = None,
    base_model: str | None = None,
    dataset_name: str | None = None,
    hub_model_id: str | None = None,
    tags: list[str] | None = None,
    paper: Paper | None = None,
    value_model_dir: str | None = None,
    tracker_urls: dict[str, str] | None = None,
    base_model_note: str | None = None,
) -> str:
    """The card's text (YAML front matter + Markdown). `paper` overrides the one of `algorithm` (foreign trainers).
    `tracker_urls`: the run's page on each experiment tracker (`tracker_run_urls`), linked as TRL's cards link them.
    `base_model_note`: a sentence on how the weights relate to `base_model` (the built-in model's quantisation)."""
    from huggingface_hub import ModelCardData

    from . import __version__

    paper = paper or PAPERS.get(algorithm or "")
    algo_name = paper.name if paper is not None else (algorithm or "an RL algorithm")
    all_tags = ["generated_from_trainer", "trl", PACKAGE_NAME]
    if algorithm:
        all_tags.append(algorithm.replace("_", "-"))
    for tag in tags or []:
        if tag not in all_tags:
            all_tags.append(tag)
    card_data = ModelCardData(
        base_model=base_model,
        datasets=[dataset_name] if dataset_name else None,
        library_name="transformers",
        model_name=model_name,
        tags=all_tags,
    )
    title = model_name or "this model"
    lines = ["---", card_data.to_yaml(), "---", "", f"# Model Card for {title}", ""]
    source = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else "a causal language model"
    data = f" on the [{dataset_name}](https://huggingface.co/datasets/{dataset_name}) dataset" if dataset_name else ""
    lines.append(f"This model is a fine-tuned version of {source}{data}, trained with **{algo_name}**"
                 + (f", the method of [{paper.title}]({paper.url})" if paper else "") + ".")
    if base_model_note:
        lines.append(base_model_note)
    lines.append(f"It has been trained with `{PACKAGE_NAME}` {__version__}, which runs {algo_name} "
                 "as a drop-in trainer of [TRL](https://github.com/huggingface/trl).")
    if value_model_dir:
        lines += ["", f"The value model (critic) trained alongside the policy is saved in `{value_model_dir}/`."]
    repo = hub_model_id or model_name or "path/to/model"
    lines += [
        "", "## Quick start", "", "```python", "from transformers import pipeline", "",
        f'generator = pipeline("text-generation", model="{repo}")',
        'print(generator([{"role": "user", "content": "What is 12 * 7?"}], max_new_tokens=256, '
        'return_full_text=False)[0]["generated_text"])',
        "```", "", "## Training procedure", "",
    ]
    links = [f"[{_TRACKER_NAMES.get(name, name)} run]({url})" for name, url in (tracker_urls or {}).items() if url]
    if links:
        lines += ["Training logs: " + ", ".join(links) + ".", ""]
    lines += [
        f"Algorithm: **{algo_name}**" + (f" ([arXiv:{paper.arxiv_id}]({paper.url}))" if paper else "") + ".", "",
        "### Training hyperparameters", "", "| Parameter | Value |", "|---|---|",
    ]
    lines += [f"| `{k}` | {_md_cell(_fmt(v))} |" for k, v in hyperparameters.items()]
    lines += ["", "### Final metrics", ""]
    if metrics:
        lines += ["| Metric | Value |", "|---|---|"]
        lines += [f"| `{k}` | {_md_cell(_fmt(v))} |" for k, v in metrics.items()]
    else:
        lines.append("No metrics were logged.")
    lines += ["", "### Framework versions", ""]
    lines += [f"- {name}: {ver}" for name, ver in _framework_versions().items()]
    lines += ["", "## Citations", ""]
    if paper:
        lines += [f"Cite {algo_name} as:", "", "```bibtex", paper.bibtex, "```", ""]
    lines += [
        "Cite TRL as:", "", "```bibtex",
        "@software{vonwerra2020trl,",
        "    title   = {{TRL: Transformers Reinforcement Learning}},",
        "    author  = {von Werra, Leandro and Belkada, Younes and Tunstall, Lewis and Beeching, Edward and Thrush, "
        "Tristan and Lambert, Nathan and Huang, Shengyi and Rasul, Kashif and Gallou{\\'e}dec, Quentin},",
        "    license = {Apache-2.0},",
        "    url     = {https://github.com/huggingface/trl},",
        "    year    = {2020}",
        "}", "```", "",
    ]
    return "\n".join(lines)


#: how each tracker is named in the card's link to the run
_TRACKER_NAMES = {"wandb": "Weights & Biases", "trackio": "Trackio", "comet": "Comet"}


def tracker_run_urls() -> dict[str, str]:
    """The pages of the experiment-tracker runs open in this process (Weights & Biases, Trackio, Comet), found as
    TRL's own `create_model_card` finds them; trackers that are not installed or not running are left out."""
    from transformers import is_wandb_available
    from trl.trainer.utils import get_comet_experiment_url, get_trackio_space_url

    urls = {}
    if is_wandb_available():
        import wandb

        if wandb.run is not None:
            urls["wandb"] = wandb.run.url
    urls["trackio"] = get_trackio_space_url()
    urls["comet"] = get_comet_experiment_url()
    return {name: url for name, url in urls.items() if url}


def card_tags(trainer, tags: list[str], trackio_url: str | None) -> list[str]:
    """The tags TRL's cards carry besides the trainer's: `unsloth` for an Unsloth model, `hf_jobs` in a Hugging Face
    Job, `trackio:<url>` for the Trackio run (replacing any older one)."""
    out = [t for t in tags if not (trackio_url and t.startswith("trackio:"))]
    config = getattr(getattr(trainer, "model", None), "config", None)
    extra = ["unsloth"] if hasattr(config, "unsloth_version") else []
    extra += ["hf_jobs"] if "JOB_ID" in os.environ else []
    extra += [f"trackio:{trackio_url}"] if trackio_url else []
    return out + [t for t in extra if t not in out]


_HUB_CACHE_FOLDER = re.compile(r"models--([^/\\]+?)--([^/\\]+)[/\\]snapshots[/\\]")


def base_model_of(name_or_path: str | None) -> tuple[str | None, str | None]:
    """(the card's `base_model`, a note on it) for the model a run started from: a Hub id as it is; a local folder
    built by `trl_ppo_variants.smollm2` -> its Hub model (with a note: the weights are its Q4_1 GGUF, dequantised);
    a folder of the Hub cache (`.../models--org--name/snapshots/<rev>`) -> `org/name`; any other folder -> None."""
    if not name_or_path:
        return None, None
    if not os.path.isdir(name_or_path):
        return name_or_path, None
    from . import smollm2

    if os.path.isfile(os.path.join(name_or_path, smollm2.MARKER)):
        return smollm2.HUB_ID, (f"The starting weights are `{smollm2.GGUF_FILE}` of the `{smollm2.GGUF_DISTRIBUTION}` "
                                "package dequantised to float32: close to, not equal to, the Hub release.")
    match = _HUB_CACHE_FOLDER.search(os.path.abspath(name_or_path) + os.sep)
    if match:
        return f"{match.group(1)}/{match.group(2)}", None
    return None, None


def _framework_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name, dist in (("trl-ppo-variants", "trl-ppo-variants"), ("TRL", "trl"), ("Transformers", "transformers"),
                       ("PyTorch", "torch"), ("Datasets", "datasets"), ("Tokenizers", "tokenizers")):
        try:
            out[name] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def create_model_card(trainer, model_name: str | None = None, dataset_name: str | None = None,
                      tags: str | list[str] | None = None) -> str | None:
    """Write the card of `trainer`'s run to `trainer.args.output_dir/README.md` (main process only); return the path.

    Same signature as TRL's `create_model_card`, so `Trainer.push_to_hub` and `_save_checkpoint` call it unchanged.
    """
    if not trainer.is_world_process_zero():
        return None
    from trl.trainer.utils import get_config_model_id

    model = trainer.model
    config = getattr(model, "config", None)
    name_or_path = get_config_model_id(config) if config is not None else None
    # a Hub id, or a local folder whose Hub origin is known (TRL links Hub ids only); `model_card_base_model` (the
    # command line's `base_model`) names the origin of any other local folder
    base_model, base_model_note = base_model_of(name_or_path)
    explicit = getattr(trainer, "model_card_base_model", None)
    if explicit:
        base_model, base_model_note = explicit, None
    if isinstance(tags, str):
        tags = [tags]
    tags = list(tags or []) + [t for t in getattr(trainer, "_tag_names", []) if t not in (tags or [])]
    urls = tracker_run_urls()
    tags = card_tags(trainer, tags, urls.get("trackio"))
    dataset_name = dataset_name or getattr(trainer, "model_card_dataset_name", None)
    algorithm = algorithm_of(trainer)
    paper = None
    if algorithm is None and getattr(trainer, "_paper", None):  # a foreign subclass that declares its own paper
        p = trainer._paper
        paper = Paper(name=getattr(trainer, "_name", "RL"), title=p.get("title", ""), arxiv_id=p.get("id", ""),
                      bibtex=p.get("citation", ""))
    value_model_dir = None
    if getattr(trainer.args, "save_value_model", False):  # PPO/VAPO: the critic saved next to the policy, if it is
        try:
            from .critic import VALUE_MODEL_DIR
        except ImportError:
            VALUE_MODEL_DIR = "value_model"
        if os.path.isdir(os.path.join(trainer.args.output_dir, VALUE_MODEL_DIR)):
            value_model_dir = VALUE_MODEL_DIR
    text = render_model_card(
        algorithm,
        run_hyperparameters(trainer.args, trainer.accelerator.num_processes),
        final_metrics(trainer.state.log_history),
        model_name=model_name or os.path.basename(os.path.normpath(trainer.args.output_dir)),
        base_model=base_model,
        dataset_name=dataset_name,
        hub_model_id=getattr(trainer, "hub_model_id", None),
        tags=tags,
        paper=paper,
        value_model_dir=value_model_dir,
        tracker_urls=urls,
        base_model_note=base_model_note,
    )
    os.makedirs(trainer.args.output_dir, exist_ok=True)
    path = os.path.join(trainer.args.output_dir, "README.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path
