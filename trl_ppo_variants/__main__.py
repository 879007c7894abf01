"""`python -m trl_ppo_variants <algorithm> ...`: the `trl-ppo-variants` command (also under `accelerate launch -m`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
