"""trl_ppo_variants: PPO-family RL algorithms for LLMs as drop-in TRL trainers.

Swap `GRPOTrainer`/`GRPOConfig` for any pair below; everything else TRL gives (vLLM, PEFT, reward functions,
logging, `push_to_hub`, `accelerate launch`, DeepSpeed) stays.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it (imported lazily: `import trl_ppo_variants` stays cheap)
_EXPORTS = {
    "VariantConfig": "trainers.base",
    "VariantTrainer": "trainers.base",
    "GRPOConfig": "trainers.grpo",
    "GRPOTrainer": "trainers.grpo",
    "RLOOConfig": "trainers.rloo",
    "RLOOTrainer": "trainers.rloo",
    "ReMaxConfig": "trainers.remax",
    "ReMaxTrainer": "trainers.remax",
    "ReinforcePPConfig": "trainers.reinforce_pp",
    "ReinforcePPTrainer": "trainers.reinforce_pp",
    "DAPOConfig": "trainers.dapo",
    "DAPOTrainer": "trainers.dapo",
    "PPOConfig": "trainers.ppo",
    "PPOTrainer": "trainers.ppo",
    "VAPOConfig": "trainers.vapo",
    "VAPOTrainer": "trainers.vapo",
    "TTRLConfig": "trainers.ttrl",
    "TTRLTrainer": "trainers.ttrl",
    "ProcessGRPOConfig": "trainers.process_grpo",
    "ProcessGRPOTrainer": "trainers.process_grpo",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        module = importlib.import_module(f".{_EXPORTS[name]}", __name__)
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trl_ppo_variants' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
