"""The value model (critic) of `PPOTrainer` and `VAPOTrainer`.

A critic is a backbone (the causal LM's own base model: `LlamaModel` for `LlamaForCausalLM`, ...) plus a scalar value
head (`score`, a linear layer `hidden_size -> 1`). Built from the policy's in-memory base model class, it exists for
every architecture `trl.GRPOTrainer` trains, `trust_remote_code` ones included (no `AutoModelForTokenClassification`
needed). Two backbones (`critic_backbone`):

- `"full"` (`ValueModel`): a trained copy of the backbone, with its own gradients and optimizer state.
- `"lora"` (`LoraValueModel`): frozen base weights plus a LoRA adapter (and the head): no full gradients or optimizer
  state. The frozen weights are shared where they exist already (`LoraValueModel.base_source`):
  - `"policy_adapter"`: a LoRA (PEFT) policy's own base model, with the critic as a second PEFT adapter (`"critic"`)
    switched in around the critic's forward (PEFT's multi-adapter API) and out again;
  - `"reference"`: a full-fine-tuning policy's reference model (loaded for a KL: PPO's default KL in the reward), with
    the adapter applied by forward hooks that exist only during the critic's forward, so the reference model itself is
    never modified;
  - `"copy"`: a frozen copy of the base weights otherwise (no reference model, `sync_ref_model=True` whose reference
    moves, `value_model_path`, DeepSpeed ZeRO-3, which partitions the reference model in its own engine).

Vision-language models: the backbone is the VLM's base model (`Qwen2VLModel`, `Gemma3Model`, ...: vision tower,
projector and language model), the head reads the language model's hidden states (`text_config.hidden_size`), and
`critic_values` passes the batch's image inputs (`pixel_values`, `image_grid_thw`, `token_type_ids`, ...; each chunk
its own rows', split per row by `rollout.pack_multimodal`, the one mechanism row selection and ReMax use too) so
that the critic sees what the policy sees: a full critic trains its own vision tower, a LoRA critic adapts the frozen
one (its adapter covers the vision tower's linear layers too).

The critic is attached to the policy as a submodule (`policy.critic`; PEFT: of its base model), so the trainer prepares
ONE model: DDP and DeepSpeed ZeRO-2/3 see every trained parameter in one engine and one optimizer (a second, separately
prepared model is rejected by DeepSpeed), and the critic is called directly as a submodule, never through the engine's
`forward` (which runs the policy). A borrowed base (the reference model, the PEFT policy's base) is not a registered
submodule of the critic: it is neither trained, saved with the critic nor prepared twice. The PEFT adapter's parameters
are the policy's (`...lora_A.critic.weight`): `is_critic_key` counts them as the critic's.

Gradient checkpointing reaches a shared base through the critic: during the critic's forward its decoder layers
checkpoint with a function whose backward replay runs inside the critic's context again (adapter on, dropout off),
so the recomputed activations are the critic's, not the policy's or the reference model's.

Saved critics (`value_model/`, `save_pretrained`): a full critic is `config.json` (the policy's config, `num_labels=1`)
plus weights keyed `<base_model_prefix>.*` and `score.*`, the layout of transformers' `...ForTokenClassification`: where
the architecture has that class, `AutoModelForTokenClassification.from_pretrained` loads it as before, and checkpoints
written before this class existed load into it unchanged. A LoRA critic saves the adapter (`value_adapter.safetensors`, PEFT's
key names relative to the backbone), the head (`value_head.safetensors`) and the config, which names the frozen base and
the adapter's settings. `load_value_model(path)` loads either kind on its own. Checkpoints hold the critic the same
way, in `value_model/` beside the policy's weights (which never hold it: transformers pushes a checkpoint's weight
files to the Hub as they are); `holds_critic_weights` recognises the checkpoints written before, with `critic.*` in
the policy's weights.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import re

import torch
from torch import nn

from . import rollout

__all__ = [
    "CRITIC_ATTR",
    "CRITIC_ADAPTER",
    "CRITIC_BACKBONES",
    "VALUE_MODEL_DIR",
    "ValueModel",
    "LoraValueModel",
    "build_critic",
    "load_value_model",
    "attach_critic",
    "policy_module",
    "unwrap_module",
    "get_critic",
    "critic_parameters",
    "critic_values",
    "is_critic_key",
    "holds_critic_weights",
    "split_critic_state_dict",
    "detached_critic",
    "save_critic",
    "load_critic",
    "skip_critic_params",
    "explained_variance",
]

CRITIC_ATTR = "critic"
#: name of the critic's PEFT adapter on a PEFT policy (chosen so that its parameter names contain ".critic.")
CRITIC_ADAPTER = "critic"
CRITIC_BACKBONES = ("full", "lora")
VALUE_MODEL_DIR = "value_model"
#: config.json key describing a saved critic (kind, frozen base)
CONFIG_KEY = "trl_ppo_variants_critic"
HEAD_FILE = "value_head.safetensors"
#: not PEFT's `adapter_model.safetensors`: transformers' resume would load a folder holding that file into the PEFT
#: policy as an adapter of its own
ADAPTER_FILE = "value_adapter.safetensors"
#: state-dict names under which checkpoints hold a scalar head: ours and transformers' token/sequence classification
#: (`score`, `classifier`), TRL's former `AutoModelForCausalLMWithValueHead` (`v_head.summary`)
HEAD_PREFIXES = ("score", "classifier", "v_head.summary")


def unwrap_module(model: nn.Module) -> nn.Module:
    """DDP / DeepSpeed engine / torch.compile -> the wrapped module (PEFT models are left as they are)."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        else:
            return model


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


def policy_module(model: nn.Module) -> nn.Module:
    """The `PreTrainedModel` that holds (or will hold) the critic: DDP/DeepSpeed unwrapped, PEFT's base model."""
    model = unwrap_module(model)
    if _is_peft(model):
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


def _backbone(model: nn.Module) -> nn.Module:
    """The base model of a `...ForCausalLM` (`model.model`, `model.transformer`, ...); a base model itself as is."""
    prefix = getattr(model, "base_model_prefix", "")
    inner = getattr(model, prefix, None) if prefix else None
    return inner if isinstance(inner, nn.Module) else model


def _hidden_size(config) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text.hidden_size


# ------------------------------------------------------------------------------------------------ the value head
def _init_value_head(head: nn.Linear) -> None:
    """Start a new value head near V = 0 on every state: weights N(0, 1 / (hidden_size + 1)), bias 0.

    A pretrained backbone's last hidden states are large (SmolLM2-135M: norm ~47), so transformers' N(0, 0.02) init
    of a new head gives values of std ~0.7 per token before any training: far from returns in [0, 1], and, through
    `delta_t = r_t + V_{t+1} - V_t`, GAE advantages made mostly of that noise (explained variance -3 to -20
    measured). Scaling the init by the width (as OpenRLHF's value head does) gives values of std ~||h|| / d (0.08
    there), so the first advantages are close to the lambda-discounted returns. Not exactly zero: the backbone's
    gradient is proportional to the head's weights, and a zero head would leave it untrained until the head grows. (On
    the toy task the two inits learn alike: 60-step gains over seeds 0-7, PPO +0.13 zero vs +0.10 and +0.13 scaled,
    VAPO +0.07 vs +0.08; a single seed's +0.08 vs +0.15 was the noise of one run.)
    """
    params = [p for p in (head.weight, head.bias) if p is not None]
    gathered = contextlib.nullcontext()
    if _is_zero3_partitioned(head):  # every rank holds a shard, rank 0's write is broadcast
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params, modifier_rank=0)
    with gathered, torch.no_grad():
        head.weight.normal_(mean=0.0, std=1.0 / (head.in_features + 1))
        if head.bias is not None:
            head.bias.zero_()


def _checkpoint_files(path: str) -> list[str]:
    if not os.path.isdir(path):
        return []
    names = sorted(f for f in os.listdir(path) if f.endswith(".safetensors") and f not in (ADAPTER_FILE,))
    if not names:
        names = sorted(f for f in os.listdir(path) if f.endswith(".bin") and f.startswith("pytorch_model"))
    return [os.path.join(path, n) for n in names]


def _read_tensors(files: list[str], wanted) -> dict[str, torch.Tensor]:
    """The tensors whose key satisfies `wanted(key)` in safetensors / torch files (read lazily where possible)."""
    out = {}
    for file in files:
        if file.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(file, "pt") as handle:
                for key in handle.keys():
                    if wanted(key):
                        out[key] = handle.get_tensor(key)
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
            out.update({k: v for k, v in state.items() if wanted(k)})
    return out


def checkpoint_head(path: str | None, hidden_size: int) -> dict[str, torch.Tensor]:
    """`{"weight": (1, H), "bias": (1,)}` (either may be missing) of a scalar head held by the checkpoint at `path`,
    under any of `HEAD_PREFIXES`; {} when it holds none (a causal LM, a base model) or when a head there is not
    scalar (a classifier with several labels)."""
    if path is None:
        return {}
    files = [os.path.join(path, HEAD_FILE)] if os.path.isfile(os.path.join(path, HEAD_FILE)) else \
        _checkpoint_files(path)
    names = {f"{prefix}.{part}": part for prefix in HEAD_PREFIXES for part in ("weight", "bias")}
    found = _read_tensors(files, lambda key: key in names)
    for prefix in HEAD_PREFIXES:
        head = {names[k]: v for k, v in found.items() if k.startswith(prefix + ".")}
        if "weight" in head:
            if tuple(head["weight"].shape) != (1, hidden_size):
                return {}
            return head
    return {}


def _set_head(head: nn.Linear, loaded: dict[str, torch.Tensor]) -> None:
    """Load the head from `loaded` where it has its weights; any part it lacks starts as a new head does (issue: a
    head missing from the checkpoint must never keep transformers' N(0, 0.02) init)."""
    if "weight" not in loaded:
        _init_value_head(head)
        return
    params = [p for p in (head.weight, head.bias) if p is not None]
    gathered = contextlib.nullcontext()
    if _is_zero3_partitioned(head):
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params, modifier_rank=0)
    with gathered, torch.no_grad():
        head.weight.copy_(loaded["weight"].to(head.weight.dtype))
        if head.bias is not None:
            head.bias.copy_(loaded["bias"].to(head.bias.dtype) if "bias" in loaded else torch.zeros_like(head.bias))


# ------------------------------------------------------------------------------------------------ critics
class _Critic(nn.Module):
    """What both critics share: the head, the output, the config that `save_pretrained` writes."""

    #: set by transformers' `gradient_checkpointing_enable` on the policy (it walks every submodule with this attribute)
    gradient_checkpointing = False
    kind = ""

    def __init__(self, config, base_model_prefix: str, dtype: torch.dtype):
        super().__init__()
        self.config = copy.deepcopy(config)
        self.config.num_labels = 1
        self.base_model_prefix = base_model_prefix
        self.score = nn.Linear(_hidden_size(config), 1, dtype=dtype)

    @property
    def backbone(self) -> nn.Module:
        raise NotImplementedError

    def _values(self, input_ids, attention_mask, **image_kwargs):
        from transformers.modeling_outputs import TokenClassifierOutput

        # a VLM's base model (`Qwen2VLModel`, `Gemma3Model`, ...) takes the image inputs and returns the language
        # model's hidden states, of `text_config.hidden_size` (the head's width, `_hidden_size`)
        if "pixel_values" in image_kwargs:
            _check_takes_images(self.backbone)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                               **image_kwargs).last_hidden_state
        return TokenClassifierOutput(logits=self.score(hidden.to(self.score.weight.dtype)))

    def _write_config(self, directory: str, extra: dict | None = None) -> None:
        """config.json: the backbone's config with one label, the architecture transformers loads a full critic with
        (`...ForTokenClassification` where it exists), and what kind of critic this is (`CONFIG_KEY`)."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

        config = copy.deepcopy(self.config)
        config.num_labels = 1
        token_cls = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES.get(getattr(config, "model_type", None))
        config.architectures = [token_cls] if token_cls and self.kind == "full" else [type(self).__name__]
        setattr(config, CONFIG_KEY, {"critic_backbone": self.kind, "base_model_prefix": self.base_model_prefix,
                                     **(extra or {})})
        config.save_pretrained(directory)


def _check_takes_images(backbone: nn.Module) -> None:
    """A backbone whose forward does not name `pixel_values` would swallow the images in its `**kwargs` and value the
    text alone: refused in one line."""
    import inspect

    if "pixel_values" not in inspect.signature(backbone.forward).parameters:
        raise NotImplementedError(f"critic: the batch holds images but the critic's backbone "
                                  f"{type(backbone).__name__}.forward takes no pixel_values (expected a "
                                  "vision-language base model such as Qwen2VLModel)")


class ValueModel(_Critic):
    """A full critic: a trained backbone (`<base_model_prefix>`) plus `score`. Its state dict has the keys of
    transformers' `...ForTokenClassification(num_labels=1)`."""

    kind = "full"

    def __init__(self, config, backbone: nn.Module, base_model_prefix: str):
        super().__init__(config, base_model_prefix, next(backbone.parameters()).dtype)
        setattr(self, base_model_prefix, backbone)

    @property
    def backbone(self) -> nn.Module:
        return getattr(self, self.base_model_prefix)

    def forward(self, input_ids=None, attention_mask=None, **image_kwargs):
        return self._values(input_ids, attention_mask, **image_kwargs)

    def save_pretrained(self, directory: str, state_dict: dict | None = None, is_main_process: bool = True, **_):
        if not is_main_process:
            return
        from huggingface_hub import save_torch_state_dict

        os.makedirs(directory, exist_ok=True)
        self._write_config(directory)
        state_dict = self.state_dict() if state_dict is None else state_dict
        save_torch_state_dict({k: _own_storage(v) for k, v in state_dict.items()}, directory)

    def load_saved(self, directory: str) -> None:
        """Load weights written by `save_pretrained` (strict: a partial load must not pass silently)."""
        files = _checkpoint_files(directory)
        if not files:
            raise FileNotFoundError(f"no weights found in {directory}")
        self.load_state_dict(_read_tensors(files, lambda key: True), strict=True)


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (detached), copied when it is a view into a larger storage (DeepSpeed's flat buffers), which safetensors
    refuses to save."""
    tensor = tensor.detach()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size() or not tensor.is_contiguous():
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _linear_targets(backbone: nn.Module, target_modules) -> dict[str, nn.Linear]:
    """The linear layers of `backbone` a LoRA adapter covers, by module path. `target_modules` None or "all-linear":
    every `nn.Linear`; else names matched as PEFT matches them (a path equal to, or ending in ".", a name)."""
    targets = {}
    for name, module in backbone.named_modules():
        if type(module) is not nn.Linear or not name:
            continue
        if target_modules in (None, "all-linear") or any(name == t or name.endswith("." + t) for t in target_modules):
            targets[name] = module
    if not targets:
        raise ValueError(f"critic_lora_target_modules: expected names of linear layers of the critic's backbone "
                         f"({type(backbone).__name__}), got {target_modules!r} (no layer matched)")
    return targets


def _trained_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of what a LoRA critic trains over frozen weights of `dtype`: float32 over half precision (as PEFT's
    `autocast_adapter_dtype`; Adam on bf16 weights loses small updates), else the weights' own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) or not dtype.is_floating_point else dtype


def _key(path: str) -> str:  # module paths as `ModuleDict` keys ("." is not allowed there)
    return path.replace(".", "__")


class _HookLora(nn.Module):
    """A LoRA adapter applied to frozen linear layers by forward hooks (`y + B(A(x)) * alpha / r`), registered only
    while `applied()` is active: the layers themselves (a reference model's, say) are never modified. A: nn.Linear's
    default (Kaiming-uniform) init; B: zero, so the adapter starts as the identity (as PEFT's LoRA). The adapter runs in
    its own dtype (float32 over half-precision weights) and adds its output in the layer's."""

    def __init__(self, targets: dict[str, nn.Linear], r: int, alpha: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.scaling = alpha / r
        self._targets = dict(targets)  # not registered: the base's modules
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        for path, linear in targets.items():
            trained = dtype or _trained_dtype(linear.weight.dtype)
            self.lora_A[_key(path)] = nn.Linear(linear.in_features, r, bias=False, dtype=trained)
            self.lora_B[_key(path)] = nn.Linear(r, linear.out_features, bias=False, dtype=trained)
            nn.init.zeros_(self.lora_B[_key(path)].weight)

    def _hook(self, key, module, args, output):
        a, b = self.lora_A[key], self.lora_B[key]
        delta = b(a(args[0].to(a.weight.dtype)))
        # in place: one temporary of the layer's output size instead of three (the frozen layer's backward does not
        # need its output)
        return output.add_(delta.to(output.dtype), alpha=self.scaling)

    @contextlib.contextmanager
    def applied(self):
        handles = [linear.register_forward_hook(functools.partial(self._hook, _key(path)))
                   for path, linear in self._targets.items()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def adapter_tensors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {path: (self.lora_A[_key(path)].weight, self.lora_B[_key(path)].weight) for path in self._targets}


class _PeftAdapter:
    """The critic as a second LoRA adapter (`CRITIC_ADAPTER`) of a PEFT policy, switched in with PEFT's
    `set_adapter` around the critic's forward. PEFT's switch also sets `requires_grad` (only the active adapter's
    parameters train); both adapters train in the same step here, so the flags of every adapter parameter are put back
    to what they were when the critic was created (also after TRL's `disable_adapter` for reference log-probs, which
    leaves only the active adapter trainable)."""

    def __init__(self, peft_model, backbone: nn.Module, r: int, alpha: float, target_modules):
        from peft import LoraConfig
        from peft.tuners.lora import LoraLayer

        targets = "all-linear" if target_modules in (None, "all-linear") else list(target_modules)
        config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, bias="none")
        peft_model.add_adapter(CRITIC_ADAPTER, config)
        self.model = peft_model
        self.layers = {name: m for name, m in backbone.named_modules()
                       if isinstance(m, LoraLayer) and CRITIC_ADAPTER in m.lora_A}
        if not self.layers:
            raise ValueError(f"critic_lora_target_modules: expected names of linear layers of the policy's backbone, "
                             f"got {target_modules!r} (no layer matched)")
        for layer in self.layers.values():
            layer.lora_A[CRITIC_ADAPTER].requires_grad_(True)
            layer.lora_B[CRITIC_ADAPTER].requires_grad_(True)
        self._flags = [(p, p.requires_grad) for m in peft_model.modules() if isinstance(m, LoraLayer)
                       for p in m.parameters(recurse=True) if p.is_floating_point()]
        self._previous = None

    @contextlib.contextmanager
    def applied(self):
        previous = self.model.active_adapter
        self.model.base_model.set_adapter(CRITIC_ADAPTER)
        try:
            yield
        finally:
            self.model.base_model.set_adapter(previous)
            self.restore_flags()

    def restore_flags(self):
        for param, flag in self._flags:
            param.requires_grad_(flag)

    def adapter_tensors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {path: (m.lora_A[CRITIC_ADAPTER].weight, m.lora_B[CRITIC_ADAPTER].weight)
                for path, m in self.layers.items()}

    @property
    def scaling(self) -> float:
        return next(iter(self.layers.values())).scaling[CRITIC_ADAPTER]


class LoraValueModel(_Critic):
    """A LoRA critic: frozen base weights (shared or a frozen copy, `base_source`), a LoRA adapter and `score`.

    Only the adapter and the head train. The base is a registered submodule (`<base_model_prefix>`) only when it is the
    critic's own frozen copy; a borrowed base (the reference model's, the PEFT policy's) is held unregistered.
    """

    kind = "lora"

    def __init__(self, config, base: nn.Module, base_model_prefix: str, base_source: str, *, r: int, alpha: float,
                 target_modules=None, peft_model=None, trained_dtype: torch.dtype | None = None):
        trained_dtype = trained_dtype or _trained_dtype(next(base.parameters()).dtype)
        super().__init__(config, base_model_prefix, trained_dtype)
        self.base_source = base_source
        self.lora_r, self.lora_alpha = r, alpha
        if base_source == "copy":
            base.requires_grad_(False)
            setattr(self, base_model_prefix, base)
        else:
            self._borrowed = (base,)  # a tuple: not a registered submodule
        if base_source == "policy_adapter":
            self._peft = _PeftAdapter(peft_model, base, r, alpha, target_modules)
        else:
            base.requires_grad_(False)  # no gradient (nor its memory) for the shared / frozen weights
            self.lora = _HookLora(_linear_targets(base, target_modules), r, alpha, trained_dtype)
        self._depth = 0

    @property
    def backbone(self) -> nn.Module:
        return getattr(self, self.base_model_prefix) if self.base_source == "copy" else self._borrowed[0]

    @property
    def adapter(self):
        return self._peft if self.base_source == "policy_adapter" else self.lora

    def restore_trainable(self) -> None:
        """Make the critic's PEFT adapter (and the policy's) trainable again after PEFT switched adapters (loading an
        adapter, TRL's `disable_adapter`): both train in every step."""
        if self.base_source == "policy_adapter":
            self._peft.restore_flags()

    def forward(self, input_ids=None, attention_mask=None, **image_kwargs):
        with self.activated():
            return self._values(input_ids, attention_mask, **image_kwargs)

    @contextlib.contextmanager
    def activated(self):
        """The base runs as the critic: adapter on, every module in eval mode (no dropout), and its decoder layers
        checkpointed (when gradient checkpointing is on) by a function whose replay re-enters this context."""
        if self._depth:
            yield
            return
        from transformers.modeling_layers import GradientCheckpointingLayer

        base = self.backbone
        modes = [(m, m.training) for m in base.modules()]
        layers = [m for m in base.modules() if isinstance(m, GradientCheckpointingLayer)]
        saved = [(m, m.__dict__.get("gradient_checkpointing", _MISSING),
                  m.__dict__.get("_gradient_checkpointing_func", _MISSING)) for m in layers]
        checkpointing = bool(self.gradient_checkpointing and self.training)
        self._depth += 1
        try:
            with self.adapter.applied():
                for module, _ in modes:
                    module.training = False
                for layer in layers:
                    # only the layer's own flag: `GradientCheckpointingLayer` checkpoints in training mode only
                    layer.training = checkpointing
                    layer.gradient_checkpointing = checkpointing
                    layer._gradient_checkpointing_func = self._checkpoint
                yield
        finally:
            self._depth -= 1
            for module, mode in modes:
                module.training = mode
            for layer, flag, func in saved:
                _restore(layer, "gradient_checkpointing", flag)
                _restore(layer, "_gradient_checkpointing_func", func)

    def _checkpoint(self, function, *args):
        # non-reentrant always: the frozen base's inputs do not require grad, which a reentrant checkpoint would need
        # for the adapter's gradients
        from torch.utils.checkpoint import checkpoint

        return checkpoint(functools.partial(self._replay, function), *args, use_reentrant=False)

    def _replay(self, function, *args, **kwargs):
        with self.activated():  # a no-op in the forward; during backward, the critic's context again
            return function(*args, **kwargs)

    # ------------------------------------------------------------------------------------------ save / load
    def trained_state(self, state_dict: dict | None = None) -> dict[str, torch.Tensor]:
        """`{"score.weight", "score.bias", "<module path>.lora_A.weight", "<module path>.lora_B.weight"}`: what the
        critic trains, adapter keys relative to the backbone. `state_dict`: the critic's keys from a gathered state
        dict (DeepSpeed), which then supplies the values."""
        out = {f"score.{k}": v for k, v in self.score.state_dict().items()}
        for path, (a, b) in self.adapter.adapter_tensors().items():
            out[f"{path}.lora_A.weight"], out[f"{path}.lora_B.weight"] = a, b
        if state_dict:
            lookup = {self._state_key(k): v for k, v in state_dict.items()}
            out = {k: lookup.get(k, v) for k, v in out.items()}
        return out

    def _state_key(self, key: str) -> str:
        """A critic key of the policy's state dict (`split_critic_state_dict`) -> its `trained_state` key."""
        match = re.match(r"lora\.lora_([AB])\.(.+)\.weight$", key)
        if match:
            return f"{match.group(2).replace('__', '.')}.lora_{match.group(1)}.weight"
        prefix = self.base_model_prefix + "."
        if key.startswith("base_model.model." + prefix):  # the PEFT adapter's keys, relative to the causal LM
            return key[len("base_model.model." + prefix):]
        return key

    def save_pretrained(self, directory: str, state_dict: dict | None = None, is_main_process: bool = True, **_):
        """The adapter (PEFT's key names, relative to the backbone), the head, and the config naming the frozen base
        and the adapter's settings."""
        from huggingface_hub import save_torch_state_dict

        gathered = self._gathered() if not state_dict else contextlib.nullcontext()
        with gathered:
            trained = {k: v.detach().cpu().clone().contiguous() for k, v in self.trained_state(state_dict).items()}
        if not is_main_process:
            return
        os.makedirs(directory, exist_ok=True)
        head = {k: trained.pop(k) for k in list(trained) if k.startswith("score.")}
        save_torch_state_dict(head, directory, filename_pattern=HEAD_FILE.replace(".safetensors", "{suffix}.safetensors"))
        adapter = {f"base_model.model.{k}": v for k, v in trained.items()}
        save_torch_state_dict(adapter, directory,
                              filename_pattern=ADAPTER_FILE.replace(".safetensors", "{suffix}.safetensors"))
        paths = sorted({k.rsplit(".lora_", 1)[0] for k in trained})
        base = getattr(self.config, "_name_or_path", None)
        self._write_config(directory, {"base_model_name_or_path": base, "lora_r": self.lora_r,
                                       "lora_alpha": self.lora_alpha, "target_modules": paths})

    def load_saved(self, directory: str) -> None:
        """Load what `save_pretrained` wrote (strict: every adapter layer and the head, nothing else)."""
        head = _read_tensors([os.path.join(directory, HEAD_FILE)], lambda key: True)
        adapter = _read_tensors([os.path.join(directory, ADAPTER_FILE)], lambda key: True)
        loaded = {**head, **{k[len("base_model.model."):]: v for k, v in adapter.items()}}
        with self._gathered(modifier_rank=0):
            own = self.trained_state()
            if set(own) != set(loaded):
                missing, unexpected = sorted(set(own) - set(loaded)), sorted(set(loaded) - set(own))
                raise RuntimeError(f"{directory}: the saved critic does not match this LoRA critic (missing "
                                   f"{missing[:4]}, unexpected {unexpected[:4]})")
            with torch.no_grad():
                for key, tensor in own.items():
                    tensor.copy_(loaded[key].to(tensor.dtype))

    def _gathered(self, modifier_rank=None):
        params = [self.score.weight, self.score.bias] + [t for pair in self.adapter.adapter_tensors().values()
                                                         for t in pair]
        if not any(hasattr(p, "ds_id") for p in params):
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


_MISSING = object()


def _restore(obj, name, value):
    if value is _MISSING:
        obj.__dict__.pop(name, None)
    else:
        setattr(obj, name, value)


# ------------------------------------------------------------------------------------------------ building
def _plain_state_dict(state_dict: dict) -> dict:
    """A backbone state dict without PEFT's injections: adapter weights dropped, `base_layer` / `original_module`
    unwrapped (the critic starts from the base weights; LoRA B is zero at injection anyway)."""
    plain = {}
    for key, value in state_dict.items():
        if "lora_" in key or ".modules_to_save." in key:
            continue
        plain[key.replace(".base_layer.", ".").replace(".original_module.", ".")] = value
    return plain


def _copy_backbone(policy: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A new instance of the policy's backbone class (the architecture's base model, in memory: any architecture,
    `trust_remote_code` ones included) holding a copy of the policy's base weights (without PEFT's adapters)."""
    from transformers.initialization import no_init_weights

    src = _backbone(policy)
    config = copy.deepcopy(src.config if hasattr(src, "config") else policy.config)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as `from_config(dtype=...)`: buffers computed in float32 stay float32
    try:
        with no_init_weights():
            dst = type(src)(config)
    finally:
        torch.set_default_dtype(default)
    missing, unexpected = dst.load_state_dict(_plain_state_dict(src.state_dict()), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"cannot copy the policy backbone into the critic: missing {missing}, unexpected "
                           f"{unexpected}")
    return dst


def _load_backbone(path: str, backbone_cls=None, **kwargs) -> nn.Module:
    """The base model of the checkpoint at `path` (a causal LM, a value or reward model, a base model): with
    `backbone_cls` (the policy's, for the policy's own checkpoint) first when given, else as the checkpoint's config
    says (AutoModel, then a causal LM's base model)."""
    from transformers import AutoModel, AutoModelForCausalLM

    loaders = [backbone_cls.from_pretrained] if backbone_cls is not None else []
    loaders += [AutoModel.from_pretrained, lambda *a, **k: _backbone(AutoModelForCausalLM.from_pretrained(*a, **k))]
    error = None
    for load in loaders:
        try:
            return load(path, **kwargs)
        except (ValueError, OSError, KeyError) as e:
            error = e
    raise ValueError(f"value_model_path: expected a checkpoint whose base model transformers can build (AutoModel or "
                     f"AutoModelForCausalLM), got {path!r} ({error})")


def _dropout_off(module: nn.Module) -> None:
    # Values are regression targets compared against the rollout-time values (value clipping): dropout would make the
    # two disagree for no reason, so the critic never uses it.
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0


def build_critic(
    policy: nn.Module,
    value_model_path: str | None = None,
    *,
    critic_backbone: str = "full",
    reference: nn.Module | None = None,
    lora_r: int = 16,
    lora_alpha: float = 32,
    lora_target_modules=None,
    **init_kwargs,
) -> nn.Module:
    """A value model for `policy` (a `...ForCausalLM`, possibly PEFT-wrapped).

    - `value_model_path` given: the backbone and, when the checkpoint holds one, the scalar head are loaded from there
      (a value or reward model, or a causal LM such as the policy's own checkpoint);
    - otherwise initialised from the policy: its backbone weights are copied from the in-memory policy, or, when the
      policy's parameters are partitioned by ZeRO-3 (nothing to copy on this rank), loaded from the policy's checkpoint
      path. A head the checkpoint does not hold starts near zero (see `_init_value_head`), whatever the path.

    `critic_backbone="lora"`: see the module docstring for where its frozen weights come from; `reference` is the
    (unwrapped) reference model to share, or None. The critic gets the policy's dtype unless `init_kwargs` says
    otherwise.
    """
    peft_model = unwrap_module(policy)
    peft_model = peft_model if _is_peft(peft_model) else None
    policy = policy_module(policy)
    dtype = init_kwargs.pop("dtype", None) or policy.dtype
    zero3 = _is_zero3_partitioned(policy)
    prefix = getattr(policy, "base_model_prefix", "") or "model"
    backbone_cls = type(_backbone(policy))
    path = value_model_path
    if path is None and zero3:
        path = policy.config._name_or_path
        if not path or not os.path.isdir(path):
            raise ValueError(
                "value_model_path: expected a checkpoint directory to initialise the critic from under ZeRO-3 (the "
                f"policy's parameters are partitioned and it was not loaded from a local path), got {path!r}"
            )
    head = checkpoint_head(value_model_path, _hidden_size(policy.config))  # the policy's own head is never a value

    source = "copy"
    if critic_backbone == "lora" and value_model_path is None and not zero3:
        if peft_model is not None and _peft_lora_shareable(peft_model):
            source = "policy_adapter"
        elif peft_model is None and reference is not None and not _is_zero3_partitioned(reference):
            source = "reference"
    if source == "policy_adapter":
        base = _backbone(policy)
    elif source == "reference":
        base = _backbone(reference)
    elif path is not None:
        own = value_model_path is None  # ZeRO-3: the policy's own checkpoint, read as the policy's class
        base = _load_backbone(path, backbone_cls if own else None, dtype=dtype, **init_kwargs)
    else:
        base = _copy_backbone(policy, dtype)
    config = copy.deepcopy(base.config if hasattr(base, "config") else policy.config)
    if critic_backbone == "full":
        _dropout_off(base)
        critic = ValueModel(config, base, prefix)
    else:
        if source == "copy":
            _dropout_off(base)
        # ZeRO-3 partitions every trainable parameter into one flat buffer per dtype group and asserts a single dtype:
        # the adapter and head then take the policy's (DeepSpeed keeps float32 master weights under bf16/fp16)
        critic = LoraValueModel(config, base, prefix, source, r=lora_r, alpha=lora_alpha,
                                target_modules=lora_target_modules, peft_model=peft_model,
                                trained_dtype=policy.dtype if zero3 else None)
    _set_head(critic.score, head)
    return critic


def _peft_lora_shareable(peft_model) -> bool:
    """A PEFT policy whose adapter is LoRA without `modules_to_save` can take the critic as a second adapter (another
    PEFT type cannot be mixed with LoRA; a module saved by the policy's adapter would be the policy's own copy inside
    the critic)."""
    config = peft_model.peft_config.get(peft_model.active_adapter)
    return (getattr(config, "peft_type", None) is not None and str(config.peft_type.value) == "LORA"
            and not getattr(config, "modules_to_save", None))


def load_value_model(path: str, base_model: str | None = None, **kwargs) -> nn.Module:
    """Load a critic saved in `value_model/` on its own (a full critic, or a LoRA critic over its base model: the one
    its config names, or `base_model`). Also loads a value model saved by transformers' `...ForTokenClassification`
    with one label. Returns a `ValueModel` or `LoraValueModel` (call `critic_values` on it)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, **{k: v for k, v in kwargs.items() if k == "trust_remote_code"})
    saved = getattr(config, CONFIG_KEY, None) or {}
    prefix = saved.get("base_model_prefix", "model")
    if saved.get("critic_backbone") == "lora":
        base_path = base_model or saved.get("base_model_name_or_path")
        base = _load_backbone(base_path, **kwargs)
        critic = LoraValueModel(base.config, base, prefix, "copy", r=saved["lora_r"], alpha=saved["lora_alpha"],
                                target_modules=saved["target_modules"])
        critic.load_saved(path)
        return critic.eval()
    if saved.get("critic_backbone") == "full":
        # our own layout (`ValueModel.save_pretrained`): built from the config and loaded strictly by key, not through
        # `from_pretrained`, whose checkpoint-conversion rules for a VLM's base model (Qwen2-VL's
        # `^model` -> `model.language_model`) would misplace the vision tower's weights
        from transformers import AutoModel
        from transformers.initialization import no_init_weights

        dtype = kwargs.get("dtype") or getattr(config, "dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype  # as saved, like `from_pretrained`
        with no_init_weights():
            base = AutoModel.from_config(config, dtype=dtype, trust_remote_code=kwargs.get("trust_remote_code", False))
        critic = ValueModel(config, base, prefix)
        critic.load_saved(path)
        return critic.eval()
    base = _load_backbone(path, **kwargs)
    critic = ValueModel(base.config, base, prefix)
    _set_head(critic.score, checkpoint_head(path, _hidden_size(base.config)))
    return critic.eval()


def attach_critic(model: nn.Module, critic: nn.Module) -> None:
    """Register `critic` as the `critic` submodule of the policy (PEFT: of its base model)."""
    target = policy_module(model)
    if getattr(target, CRITIC_ATTR, None) is not None:
        raise ValueError("the policy already has a `critic` submodule")
    setattr(target, CRITIC_ATTR, critic)


def critic_parameters(model: nn.Module) -> list[torch.nn.Parameter]:
    """The trainable parameters of the critic attached to `model`: the critic submodule's and, for a critic that is a
    PEFT adapter of the policy, that adapter's."""
    return [p for n, p in model.named_parameters() if is_critic_key(n) and p.requires_grad]


def critic_values(
    critic: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    batch_size: int | None = None,
    image_fields: dict | None = None,
) -> torch.Tensor:
    """Per-token values V(s_t) of the last `logits_to_keep` (completion) tokens.

    The value of completion token t is read at the position before it (the state in which token t is chosen), the
    same alignment as the log-probabilities.

    Args:
        input_ids: (B, P + T) prompt (left-padded) and completion (right-padded) ids.
        attention_mask: (B, P + T)
        logits_to_keep: T
        batch_size: rows per forward pass (chunks bound the activation memory at rollout time).
        image_fields: a VLM's image inputs of the B rows in TRL's layout (`rollout.image_inputs(batch)`): each
            chunk gets its rows' images, and a chunk without any image none (`rollout.image_chunks`), so that the
            critic sees what the policy sees.
    Returns:
        (B, T) float32 values (padding positions hold whatever the head outputs: mask them).
    """
    chunks = []
    for start, end, chunk_images in rollout.image_chunks(image_fields or {}, input_ids.shape[0], batch_size):
        # the per-row counts only say how the image tensors split: not model inputs
        chunk_images = {k: v for k, v in chunk_images.items() if k not in rollout.COUNT_KEYS}
        out = critic(input_ids=input_ids[start:end], attention_mask=attention_mask[start:end], **chunk_images)
        chunks.append(out.logits[:, -logits_to_keep - 1 : -1, 0].float())
    return torch.cat(chunks, dim=0)


#: a PEFT adapter parameter of the critic adapter: `...<module>.lora_A.critic.weight`
_ADAPTER_KEY = re.compile(r"\.lora_[A-Za-z_]+\." + CRITIC_ADAPTER + r"(\.|$)")


def is_critic_key(name: str) -> bool:
    """Whether a parameter / state-dict key belongs to the critic (`critic.x`, `<prefix>.critic.x`, or a parameter of
    the critic's PEFT adapter `<module>.lora_A.critic.weight`)."""
    return name.startswith(CRITIC_ATTR + ".") or f".{CRITIC_ATTR}." in name


def _critic_local_key(name: str) -> str:
    if _ADAPTER_KEY.search(name) and not name.startswith(CRITIC_ATTR + "."):
        return _ADAPTER_KEY.sub(lambda m: m.group(0).replace("." + CRITIC_ADAPTER, "", 1), name)
    marker = CRITIC_ATTR + "."
    idx = 0 if name.startswith(marker) else name.index("." + marker) + 1
    return name[idx + len(marker) :]


def holds_critic_weights(path: str) -> bool:
    """Whether the policy's weight files in the checkpoint folder `path` hold critic keys (checkpoints written before
    the critic was saved apart, in `value_model/`)."""
    from safetensors import safe_open

    for file in _checkpoint_files(path):
        if not file.endswith(".safetensors"):
            if _read_tensors([file], is_critic_key):
                return True
            continue
        with safe_open(file, "pt") as handle:
            if any(is_critic_key(key) for key in handle.keys()):
                return True
    return False


def split_critic_state_dict(state_dict: dict) -> tuple[dict, dict]:
    """`{policy keys}, {critic keys}` from a state dict of the policy with its critic: the critic submodule's keys
    without the `critic.` prefix; the critic adapter's (PEFT) keys without the adapter name."""
    policy, critic = {}, {}
    for key, value in state_dict.items():
        if is_critic_key(key):
            critic[_critic_local_key(key)] = value
        else:
            policy[key] = value
    return policy, critic


@contextlib.contextmanager
def detached_critic(model: nn.Module):
    """Temporarily remove the critic from the policy (to export a plain policy); yields the critic (or None). A critic
    that is a PEFT adapter of the policy stays in the PEFT config (PEFT filters the other adapters' weights out of an
    adapter's file by that config) but is left out of what the policy's `save_pretrained` writes."""
    target = policy_module(model)
    critic = target._modules.pop(CRITIC_ATTR, None)
    peft_model = unwrap_module(model)
    patched = _is_peft(peft_model) and CRITIC_ADAPTER in peft_model.peft_config
    if patched:
        others = [name for name in peft_model.peft_config if name != CRITIC_ADAPTER]
        peft_model.save_pretrained = functools.partial(type(peft_model).save_pretrained, peft_model,
                                                       selected_adapters=others)
    try:
        yield critic
    finally:
        if critic is not None:
            target._modules[CRITIC_ATTR] = critic
        if patched:
            del peft_model.save_pretrained


def save_critic(critic: nn.Module, directory: str, state_dict: dict | None = None, is_main_process: bool = True):
    """Save the critic to `directory` (`ValueModel` / `LoraValueModel.save_pretrained`; see the module docstring)."""
    critic.save_pretrained(directory, state_dict=state_dict, is_main_process=is_main_process)


def load_critic(critic: nn.Module, directory: str) -> None:
    """Load weights saved by `save_critic` into `critic` (strict: a partial load must not pass silently)."""
    critic.load_saved(directory)


def skip_critic_params(named_params):
    """Filter `(name, tensor)` pairs, dropping the critic's (vLLM weight sync must receive the policy only).

    Consumes the whole iterator: gathering a ZeRO-3 parameter is a collective every rank must join.
    """
    for name, param in named_params:
        if not is_critic_key(name):
            yield name, param


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`1 - Var[R - V] / Var[R]` over the valid entries (NaN when the returns have no variance: a batch whose rewards
    are all equal, where rounding alone would otherwise give values like -6e13).

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
    if var_r <= 1e-10 * (1.0 + ((r * m).sum() / count) ** 2):
        return torch.tensor(float("nan"))
    return 1.0 - var(diff) / var_r
