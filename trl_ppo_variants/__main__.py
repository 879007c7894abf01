"""`python -m trl_ppo_variants <algorithm> ...`: the `trl-ppo-variants` command (also under `accelerate launch -m`)."""

from .cli import entry

if __name__ == "__main__":
    entry()
