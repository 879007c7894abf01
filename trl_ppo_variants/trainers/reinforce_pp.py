"""REINFORCE++ and REINFORCE++-baseline (Hu et al., arXiv 2501.03262)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import rollout
from ..advantages import reinforce_pp_advantages, reinforce_pp_baseline_advantages
from ..errors import check
from ..process import StepRewardFields, StepRewardsMixin
from ..screening import PromptSelectionFields, PromptSelectionMixin
from .base import VariantConfig, VariantTrainer

#: OpenRLHF's typical `--init_kl_coef` for REINFORCE++ (k1 KL in the reward) and for REINFORCE++-baseline (k2 loss).
DEFAULT_KL_IN_REWARD_COEF = 0.01
DEFAULT_BASELINE_KL_LOSS_COEF = 1e-3


@dataclass
class ReinforcePPConfig(StepRewardFields, PromptSelectionFields, VariantConfig):
    r"""
    Configuration for [`ReinforcePPTrainer`]: [`~trl.GRPOConfig`] with the fields of REINFORCE++ (arXiv 2501.03262).

    The two variants use the KL differently, so the two KL coefficients mean:

    | variant | `kl_in_reward_coef` | `beta` |
    |---|---|---|
    | REINFORCE++ (`baseline=False`) | beta of Eq. 4: the token reward is `-coef * k1_t` (+ the outcome at the last token), default `0.01` | a KL term in the loss (TRL's k3 unless `kl_loss_estimator` says otherwise), default `0.0` (the paper has none) |
    | REINFORCE++-baseline (`baseline=True`) | must be `0.0` (the paper puts this variant's KL in the loss) | coefficient of the k2 KL loss of Eq. 8, default `1e-3` |

    `k1_t = log pi_old(y_t) - log pi_ref(y_t)`, the policy that sampled against the reference (Eq. 5). The policy loss
    is `GRPOTrainer`'s PPO-clip loss; the default `loss_type="dapo"` is the token-level mean over the generation
    batch, as the paper. `scale_rewards` (GRPO's) is not used: both variants whiten over the batch's tokens.

    Samples per prompt: the paper's REINFORCE++ samples ONE response per prompt (its baseline is the whitening over
    the batch, no group), so `num_generations=1` is accepted when `baseline=False` (TRL's `GRPOConfig` refuses it);
    REINFORCE++-baseline subtracts the group mean and needs `num_generations >= 2`; it alone takes `prompt_selection`
    (fields of [`~trl_ppo_variants.screening.PromptSelectionFields`]). TRL's `frac_reward_zero_std` is
    not logged for groups of one (it would always be 1); `reward_std` is the std over the batch.

    Step rewards (process supervision, REINFORCE++ only): `step_reward_funcs=[...]` passed to the trainer, or a
    process reward model (`process_reward_model_path`), add each step's reward at the token that ends the step to the
    token rewards of Eq. 4, so the returns are dense. REINFORCE++-baseline broadcasts one outcome advantage and refuses
    them. Fields `step_separator`, `process_reward_model_path`, `process_reward_model_style`,
    `process_reward_model_step_tag`: see [`~trl_ppo_variants.process.StepRewardFields`].

    Parameters:
        baseline (`bool`, *optional*, defaults to `False`):
            `False`: REINFORCE++ (Eq. 4-6), per-token discounted returns of the KL-penalised reward, whitened over
            all valid tokens of the global batch. `True`: REINFORCE++-baseline (Eq. 7-8), `r - mean_group(r)`
            broadcast to the tokens, whitened over all valid tokens of the global batch, with a k2 KL loss term.
        gamma (`float`, *optional*, defaults to `1.0`):
            Discount of the returns (REINFORCE++ only; the paper uses 1). Must be 1 for the baseline variant, whose
            advantage is a broadcast outcome.
        kl_in_reward_coef (`float` or `None`, *optional*, defaults to `None`):
            `None` means `0.01` for REINFORCE++ and `0.0` for REINFORCE++-baseline (see the table).
        beta (`float` or `None`, *optional*, defaults to `None`):
            `None` means `0.0` for REINFORCE++ and `1e-3` for REINFORCE++-baseline (see the table).
        kl_loss_estimator (`str` or `None`, *optional*, defaults to `None`):
            Estimator of the KL loss term weighted by `beta`. `None` means `"k2"` for REINFORCE++-baseline (Eq. 8) and
            `"k3"` (TRL's) for REINFORCE++.
        use_bias_correction_kl (`bool`, *optional*, defaults to `False`):
            As in [`~trl.GRPOConfig`] (whose default is `True`): weight the KL loss term by the importance ratio. Off
            by default here because the paper's k2 loss (Eq. 8) has no such weight; on-policy the weight is 1 but its
            gradient is not 0, so it would change the KL gradient.
    """

    baseline: bool = field(
        default=False, metadata={"help": "True: REINFORCE++-baseline (group-mean baseline, k2 KL loss)."}
    )
    gamma: float = field(default=1.0, metadata={"help": "Discount of the per-token returns (REINFORCE++ only)."})
    kl_in_reward_coef: float | None = field(
        default=None,
        metadata={"help": "k1 KL-in-reward coefficient (Eq. 4). None: 0.01 for REINFORCE++, 0.0 for the baseline."},
    )
    beta: float | None = field(
        default=None,
        metadata={"help": "KL loss coefficient. None: 0.0 for REINFORCE++, 1e-3 (k2, Eq. 8) for the baseline."},
    )
    kl_loss_estimator: str | None = field(
        default=None, metadata={"help": "KL loss estimator. None: 'k2' for the baseline, 'k3' otherwise."}
    )
    use_bias_correction_kl: bool = field(
        default=False, metadata={"help": "Weight the KL loss by the importance ratio (the paper does not)."}
    )

    def min_num_generations(self):
        if self.baseline:
            return super().min_num_generations()
        return 1, "REINFORCE++ needs no group: its baseline is the batch whitening"

    def prompt_selection_refused(self):
        if not self.baseline:
            return ("plain REINFORCE++ has no group baseline (its baseline is the batch whitening): a group whose "
                    "rewards are all equal still has non-zero advantages; REINFORCE++-baseline (baseline=True) "
                    "supports it")
        return super().prompt_selection_refused()

    def step_rewards_refused(self):
        if self.baseline:
            return "baseline=True broadcasts one outcome advantage per completion; step rewards need baseline=False"
        return None

    def __post_init__(self):
        if self.kl_in_reward_coef is None:
            self.kl_in_reward_coef = 0.0 if self.baseline else DEFAULT_KL_IN_REWARD_COEF
        if self.beta is None:
            self.beta = DEFAULT_BASELINE_KL_LOSS_COEF if self.baseline else 0.0
        if self.kl_loss_estimator is None:
            self.kl_loss_estimator = "k2" if self.baseline else "k3"
        check(0.0 < self.gamma <= 1.0, "gamma", "a number in (0, 1]", self.gamma)
        if self.baseline:
            check(self.gamma == 1.0, "gamma", "1.0 with baseline=True (the baseline advantage is not discounted)",
                  self.gamma)
            check(self.kl_in_reward_coef == 0.0, "kl_in_reward_coef",
                  "0.0 with baseline=True (REINFORCE++-baseline's KL is the loss term weighted by `beta`)",
                  self.kl_in_reward_coef)
        super().__post_init__()


class ReinforcePPTrainer(StepRewardsMixin, PromptSelectionMixin, VariantTrainer):
    """REINFORCE++ / REINFORCE++-baseline (arXiv 2501.03262) on top of TRL's `GRPOTrainer`.

    Advantages are per token, (N, T), computed on the global batch (whitening is over every valid token of every
    process) and sliced back to this process. The KL in the reward uses the reference log-probs TRL computes when
    `beta != 0` (the base class turns that on whenever `kl_in_reward_coef > 0`).
    """

    _tag_names = ["trl", "trl-ppo-variants", "reinforce_pp"]
    config_class = ReinforcePPConfig
    needs_global_batch = True

    def __init__(self, model, reward_funcs=None, args: ReinforcePPConfig | None = None, **kwargs):
        args = self.resolve_args(args)
        super().__init__(model, reward_funcs, args=args, **kwargs)

    def compute_advantages(self, rewards, batch, group_size):
        mask = rollout.loss_mask(batch)
        if self.args.baseline:
            return reinforce_pp_baseline_advantages(rewards, mask, group_size)
        kl = batch.get("kl_in_reward")  # already k1 * mask; the function applies kl_in_reward_coef itself
        rewards, step_token_rewards = self.dense_step_rewards(rewards, mask)  # (rewards, None) without step rewards
        return reinforce_pp_advantages(
            rewards, mask, kl=kl, kl_coef=self.kl_in_reward_coef if kl is not None else 0.0, gamma=self.args.gamma,
            token_rewards=step_token_rewards,
        )
