"""What the multi-process scripts (tests/scripts/<topic>_2proc.py) share. Import it before transformers or trl.

- The process: offline, one torch thread (tests/conftest.py's setup, which this module imports).
- The toy settings: `toy_args` of tests/conftest.py, the one source for the tests and the scripts; a script passes
  only what it changes. `SPLIT_GROUPS` is the layout most scripts test: 6 rows per process with groups of 4, so the 12
  rows of a generation batch hold 3 groups and the middle one straddles the two processes.
- The command line `MODEL_DIR OUT_DIR [...]`, the weights' fingerprints that the tests compare across the ranks, and
  the exit (`main_then_finish`).

The tests start the scripts with `tests/launcher.py` (`accelerate launch --multi_gpu --num_processes 2` on CPU, a free
port, the same environment for all); by hand:
`accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no tests/scripts/X_2proc.py ...`.
"""

import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

import torch  # noqa: E402
from conftest import toy_args  # noqa: E402, F401  (also: offline environment, one torch thread)

SPLIT_GROUPS = {"per_device_train_batch_size": 6, "num_generations": 4}


def model_and_out_dirs() -> tuple[str, str]:
    """The script's two positional arguments: the toy model's folder and the folder to write the results to."""
    return sys.argv[1], sys.argv[2]


def _params(trainer):
    return trainer.accelerator.unwrap_model(trainer.model).parameters()


def flat_weights(trainer) -> torch.Tensor:
    """Every parameter of the policy, flattened into one fp32 CPU vector (compared exactly across the ranks)."""
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in _params(trainer)])


def weight_sums(trainer) -> list[float]:
    """A JSON-able fingerprint of the policy: each parameter's sum in float64, rounded to 10 decimals."""
    return [round(p.detach().double().sum().item(), 10) for p in _params(trainer)]


def main_then_finish(main) -> None:
    """Run `main`, then end the process with exit status 0 once every process is done, never with a crash in the
    interpreter's teardown (`trl_ppo_variants.distributed.finish`). A `main` that fails raises as usual."""
    main()
    from trl_ppo_variants.distributed import finish

    finish(0)
