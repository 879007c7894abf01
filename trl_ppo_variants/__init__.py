"""trl_ppo_variants: PPO-family RL algorithms for LLMs as drop-in TRL trainers.

Swap `GRPOTrainer`/`GRPOConfig` for any pair below; everything else TRL gives (vLLM, PEFT, reward functions,
logging, `push_to_hub`, `accelerate launch`, DeepSpeed) stays.
"""

from __future__ import annotations

import importlib

from .algorithms import exports as _exports

__version__ = "0.1.0"

# public name -> module that defines it (imported lazily: `import trl_ppo_variants` stays cheap); the config and
# trainer of every entry of `algorithms.REGISTRY`
_EXPORTS = _exports()

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
