"""The value model (critic) of `PPOTrainer` and `VAPOTrainer`.

Design: the critic is a separate network (its own backbone plus a scalar head, `AutoModelForTokenClassification` with
`num_labels=1`), initialised from the policy's checkpoint or from `value_model_path`, and attached to the policy as a
submodule (`policy.critic`). The trainer then prepares ONE model, so:

- DDP and DeepSpeed ZeRO-2/3 see every parameter in one engine and one optimizer (a second, separately prepared model
  is rejected by DeepSpeed, and ZeRO-2 fails with a `KeyError` on parameters it does not own);
- a checkpoint of the policy holds `critic.*` and resuming restores it with no extra code;
- the critic is called directly as a submodule (ZeRO-3 still gathers its parameters through the module hooks), never
  through the engine's `forward`, which would run the policy.

An exported policy must not carry `critic.*` keys: exports save the policy without it and the critic next to it
(`<output_dir>/value_model`). With PEFT the critic is attached after the adapter is injected, so LoRA target patterns
(`q_proj`, `all-linear`, ...) never catch the critic's projections and the critic is trained in full; PEFT saves only
the adapter, so the critic is then saved to `value_model` in every checkpoint as well.
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch
from torch import nn

__all__ = [
    "CRITIC_ATTR",
    "VALUE_MODEL_DIR",
    "build_critic",
    "attach_critic",
    "policy_module",
    "get_critic",
    "critic_values",
    "is_critic_key",
    "split_critic_state_dict",
    "detached_critic",
    "save_critic",
    "load_critic",
    "skip_critic_params",
    "explained_variance",
]

CRITIC_ATTR = "critic"
VALUE_MODEL_DIR = "value_model"


def _unwrap(model: nn.Module) -> nn.Module:
    """DDP / DeepSpeed engine / torch.compile -> the wrapped module (PEFT models are left as they are)."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        else:
            return model


def policy_module(model: nn.Module) -> nn.Module:
    """The `PreTrainedModel` that holds (or will hold) the critic: DDP/DeepSpeed unwrapped, PEFT's base model."""
    model = _unwrap(model)
    if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
        model = model.get_base_model()
    return model


def get_critic(model: nn.Module) -> nn.Module:
    """The critic attached to `model` (which may be wrapped by DDP, DeepSpeed or PEFT)."""
    critic = getattr(policy_module(model), CRITIC_ATTR, None)
    if critic is None:
        raise RuntimeError("the policy has no critic attached (expected a `critic` submodule)")
    return critic


def _is_zero3_partitioned(model: nn.Module) -> bool:
    return any(hasattr(p, "ds_id") for p in model.parameters())


def build_critic(policy: nn.Module, value_model_path: str | None = None, **init_kwargs) -> nn.Module:
    """A value model for `policy`: `AutoModelForTokenClassification(num_labels=1)`, dropout off.

    - `value_model_path` given: loaded from there (e.g. a trained reward or value model);
    - otherwise initialised from the policy: its backbone weights are copied from the in-memory policy, or, when the
      policy's parameters are partitioned by ZeRO-3 (nothing to copy on this rank), loaded from the policy's checkpoint
      path. The scalar head is new and starts near zero (see `_init_value_head`).

    The critic gets the policy's dtype unless `init_kwargs` says otherwise.
    """
    from transformers import AutoModelForTokenClassification

    policy = policy_module(policy)
    init_kwargs.setdefault("dtype", policy.dtype)
    init_kwargs["num_labels"] = 1
    new_head = value_model_path is None
    if value_model_path is None and _is_zero3_partitioned(policy):
        value_model_path = policy.config._name_or_path
        if not value_model_path or not os.path.isdir(value_model_path):
            raise ValueError(
                "value_model_path: expected a checkpoint directory to initialise the critic from under ZeRO-3 (the "
                "policy's parameters are partitioned and it was not loaded from a local path), got "
                f"{value_model_path!r}"
            )
    if value_model_path is not None:
        critic = AutoModelForTokenClassification.from_pretrained(value_model_path, **init_kwargs)
    else:
        config = copy.deepcopy(policy.config)
        config.num_labels = 1
        dtype = init_kwargs.pop("dtype")
        critic = AutoModelForTokenClassification.from_config(config, dtype=dtype)
        src = getattr(policy, policy.base_model_prefix)
        dst = getattr(critic, critic.base_model_prefix)
        missing, unexpected = dst.load_state_dict(_plain_state_dict(src.state_dict()), strict=False)
        if unexpected or missing:
            raise RuntimeError(f"cannot copy the policy backbone into the critic: missing {missing}, unexpected "
                               f"{unexpected}")
    if new_head:
        _init_value_head(critic)
    # Values are regression targets compared against the rollout-time values (value clipping): dropout would make the
    # two disagree for no reason, so the critic never uses it.
    for module in critic.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    if hasattr(critic.config, "classifier_dropout"):
        critic.config.classifier_dropout = 0.0
    return critic


def _init_value_head(critic: nn.Module) -> None:
    """Start a new value head near V = 0 on every state: weights N(0, 1 / (hidden_size + 1)), bias 0.

    A pretrained backbone's last hidden states are large (SmolLM2-135M: norm ~47), so transformers' N(0, 0.02) init
    of a new head gives values of std ~0.7 per token before any training: far from returns in [0, 1], and, through
    `delta_t = r_t + V_{t+1} - V_t`, GAE advantages made mostly of that noise (explained variance -3 to -20
    measured). Scaling the init by the width (as OpenRLHF's value head does) gives values of std ~||h|| / d (0.08
    there), so the first advantages are close to the lambda-discounted returns. Not exactly zero: the backbone's
    gradient is proportional to the head's weights, and a zero head would leave it untrained until the head grows
    (measured on the toy VAPO learning test: +0.08 instead of +0.15 in 60 steps).
    """
    head = getattr(critic, "score", None) or getattr(critic, "classifier", None)
    if not isinstance(head, nn.Linear):
        raise RuntimeError(f"cannot find the scalar head of {type(critic).__name__} (expected a `score` or "
                           "`classifier` linear layer)")
    params = [p for p in (head.weight, head.bias) if p is not None]
    gathered = contextlib.nullcontext()
    if _is_zero3_partitioned(head):  # loaded under ZeRO-3: every rank holds a shard, rank 0's write is broadcast
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params, modifier_rank=0)
    with gathered, torch.no_grad():
        head.weight.normal_(mean=0.0, std=1.0 / (head.in_features + 1))
        if head.bias is not None:
            head.bias.zero_()


def _plain_state_dict(state_dict: dict) -> dict:
    """A backbone state dict without PEFT's injections: adapter weights dropped, `base_layer` / `original_module`
    unwrapped (the critic starts from the base weights; LoRA B is zero at injection anyway)."""
    plain = {}
    for key, value in state_dict.items():
        if "lora_" in key or ".modules_to_save." in key:
            continue
        plain[key.replace(".base_layer.", ".").replace(".original_module.", ".")] = value
    return plain


def attach_critic(model: nn.Module, critic: nn.Module) -> None:
    """Register `critic` as the `critic` submodule of the policy (PEFT: of its base model)."""
    target = policy_module(model)
    if getattr(target, CRITIC_ATTR, None) is not None:
        raise ValueError("the policy already has a `critic` submodule")
    setattr(target, CRITIC_ATTR, critic)


def critic_values(
    critic: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    batch_size: int | None = None,
) -> torch.Tensor:
    """Per-token values V(s_t) of the last `logits_to_keep` (completion) tokens.

    The value of completion token t is read at the position before it (the state in which token t is chosen), the
    same alignment as the log-probabilities.

    Args:
        input_ids: (B, P + T) prompt (left-padded) and completion (right-padded) ids.
        attention_mask: (B, P + T)
        logits_to_keep: T
        batch_size: rows per forward pass (chunks bound the activation memory at rollout time).
    Returns:
        (B, T) float32 values (padding positions hold whatever the head outputs: mask them).
    """
    batch_size = batch_size or input_ids.shape[0]
    chunks = []
    for start in range(0, input_ids.shape[0], batch_size):
        out = critic(input_ids=input_ids[start : start + batch_size],
                     attention_mask=attention_mask[start : start + batch_size])
        chunks.append(out.logits[:, -logits_to_keep - 1 : -1, 0].float())
    return torch.cat(chunks, dim=0)


def is_critic_key(name: str) -> bool:
    """Whether a parameter / state-dict key belongs to the critic (`critic.x` or `<prefix>.critic.x`)."""
    return name.startswith(CRITIC_ATTR + ".") or f".{CRITIC_ATTR}." in name


def _critic_local_key(name: str) -> str:
    marker = CRITIC_ATTR + "."
    idx = 0 if name.startswith(marker) else name.index("." + marker) + 1
    return name[idx + len(marker) :]


def split_critic_state_dict(state_dict: dict) -> tuple[dict, dict]:
    """`{policy keys}, {critic keys without the `critic.` prefix}` from a state dict of the policy with its critic."""
    policy, critic = {}, {}
    for key, value in state_dict.items():
        if is_critic_key(key):
            critic[_critic_local_key(key)] = value
        else:
            policy[key] = value
    return policy, critic


@contextlib.contextmanager
def detached_critic(model: nn.Module):
    """Temporarily remove the critic from the policy (to export a plain policy); yields the critic (or None)."""
    target = policy_module(model)
    critic = target._modules.pop(CRITIC_ATTR, None)
    try:
        yield critic
    finally:
        if critic is not None:
            target._modules[CRITIC_ATTR] = critic


def save_critic(critic: nn.Module, directory: str, state_dict: dict | None = None, is_main_process: bool = True):
    """`save_pretrained` of the critic (a loadable `...ForTokenClassification` with `num_labels=1`)."""
    critic.save_pretrained(directory, state_dict=state_dict, is_main_process=is_main_process)


def load_critic(critic: nn.Module, directory: str) -> None:
    """Load weights saved by `save_critic` into `critic` (strict: a partial load must not pass silently)."""
    from transformers.modeling_utils import load_state_dict

    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors") or f.endswith(".bin"))
    if not files:
        raise FileNotFoundError(f"no weights found in {directory}")
    state_dict = {}
    for name in files:
        state_dict.update(load_state_dict(os.path.join(directory, name)))
    critic.load_state_dict(state_dict, strict=True)


def skip_critic_params(named_params):
    """Filter `(name, tensor)` pairs, dropping the critic's (vLLM weight sync must receive the policy only).

    Consumes the whole iterator: gathering a ZeRO-3 parameter is a collective every rank must join.
    """
    for name, param in named_params:
        if not is_critic_key(name):
            yield name, param


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`1 - Var[R - V] / Var[R]` over the valid entries (NaN when the returns have no variance).

    Args:
        values, returns, mask: (N, T)
    Returns:
        0-dim float tensor.
    """
    m = mask.to(torch.float32)
    count = m.sum().clamp(min=1.0)
    r = returns.float()
    diff = r - values.float()

    def var(x):
        mean = (x * m).sum() / count
        return (((x - mean) * m) ** 2).sum() / count

    var_r = var(r)
    if var_r <= 0:
        return torch.tensor(float("nan"))
    return 1.0 - var(diff) / var_r
