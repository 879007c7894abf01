"""What the benchmarks run: the rows compared (TRL's own trainers, and this package's algorithms each with the
benchmark's settings), and the meters that both the CPU suite (`bench/suite.py`) and the GPU run
(`bench/gpu_bench.py`) attach to a trainer.

A row of ours names its algorithm; where its module, classes and label come from is `trl_ppo_variants.algorithms`.
A trainer whose module does not exist yet (or fails to import) is reported as skipped with the reason; nothing here
assumes that every algorithm of the package is present.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field

from trl_ppo_variants.algorithms import ALGORITHMS, REGISTRY

# Step-time ratio targets to GRPO with the same settings, from the trainer issues (see `Algo.target`).
TOLERANCE = 1.05
# Issue 14: a KL in the reward at no extra forward pass (its log-probs come from generation): <= 1.03x GRPO with a
# reference model; DAPO in about one generation round.
KL_TOLERANCE = 1.03
DAPO_MAX_ROUNDS = 1.3
DAPO_MAX_GEN_PER_TRAINED = 1.4


@dataclass
class Algo:
    """One benchmarked configuration.

    `overrides(G)` gives the config fields set on top of the shared settings (G = the shared group size); `baseline`
    names the row the ratios are taken against; `peer` a row this one must also beat (step time ratio < 1, paired
    per round like the baseline's); `target` is one of None, "time" (step time <= 1.05x), "kl" (step time <= 1.03x,
    and faster than `peer` when set), "remax" (<= (1 + 1/G)x + 5%), "per_gen_token" (cost per generated token
    <= 1.05x), "dapo" (<= 1.3 generation rounds per step and <= 1.4 generated tokens per trained token), "value"
    (<= 1.8x time and 1.6x memory), "value_lora" (a LoRA critic: <= 1.15x memory of GRPO with a reference model, and
    the value target's time).
    """

    name: str
    label: str
    module: str
    config: str
    trainer: str
    overrides: callable = field(default=lambda g: {})
    baseline: str = "grpo"
    target: str | None = None
    peer: str | None = None
    reward: str = "addition"  # "addition": the toy task's reward; "own": the trainer brings its reward (TTRL)
    group_size: callable = field(default=lambda g: g)  # generations per prompt (TTRL: n_votes)
    batch_scale: int = 1  # generated rows per step relative to the shared batch (TTRL n_votes = 2 n_train: 2)
    cost: float = 1.0  # expected step time relative to GRPO's, to decide whether the row still fits a time budget

    def load(self):
        """(ConfigCls, TrainerCls); raises `MissingTrainer` with a one-line reason when not available."""
        try:
            mod = importlib.import_module(self.module)
        except ModuleNotFoundError as e:
            if e.name and (e.name == self.module or self.module.startswith(e.name + ".")):
                raise MissingTrainer(f"{self.module.replace('.', '/')}.py does not exist yet") from None
            raise MissingTrainer(f"import of {self.module} failed: {e}") from None
        except Exception as e:  # a trainer being written may not import yet
            raise MissingTrainer(f"import of {self.module} failed: {type(e).__name__}: {e}") from None
        try:
            return getattr(mod, self.config), getattr(mod, self.trainer)
        except AttributeError as e:
            raise MissingTrainer(f"{self.module} has no {e.name}") from None


class MissingTrainer(Exception):
    pass


def ours(name: str, overrides, label: str | None = None, algorithm: str | None = None, **kwargs) -> Algo:
    """A row training one of this package's algorithms (`algorithm`, default `name`) with the benchmark's `overrides`;
    its module, classes and (by default) label are the registry's."""
    entry = REGISTRY[algorithm or name]
    return Algo(name, label or entry.label, entry.module_path, entry.config, entry.trainer, overrides, **kwargs)


_NO_REF = {"beta": 0.0, "kl_in_reward_coef": 0.0}  # same beta as the GRPO row: no reference model anywhere

ALGOS = [
    Algo("grpo", "GRPO (TRL)", "trl", "GRPOConfig", "GRPOTrainer", lambda g: {"beta": 0.0}),
    Algo("trl_rloo", "RLOO (TRL)", "trl", "RLOOConfig", "RLOOTrainer", lambda g: {"beta": 0.0}),
    ours("rloo", lambda g: {"beta": 0.0}, target="time"),
    ours("remax", lambda g: dict(_NO_REF), target="remax", cost=1.2),
    ours("reinforce_pp", lambda g: dict(_NO_REF), target="time"),
    ours("reinforce_pp_baseline", lambda g: dict(_NO_REF, baseline=True), target="time"),
    ours("dapo", lambda g: {"beta": 0.0, "max_generation_rounds": 8}, target="dapo", cost=1.3),
    # PPO's rows pin the full critic (PPO's default until issue 28, the LoRA critic since): the stored results and the
    # labels are the full critic's; the LoRA critic's rows are `ppo_lora_ref` and `vapo_lora`
    ours("ppo", lambda g: dict(_NO_REF, critic_backbone="full"), target="value", cost=1.8),
    # one critic-only step (inside the warm-up, not timed) instead of the paper's 50; the critic's learning rate
    # VAPO's default: twice the policy's
    ours("vapo", lambda g: dict(_NO_REF, value_pretrain_steps=1, critic_learning_rate=None), target="value",
         cost=1.8),
    ours("ttrl", lambda g: {"beta": 0.0, "n_votes": g, "n_train": g}, "TTRL (n_votes = G)", target="time",
         reward="own"),
    ours("ttrl_2x", lambda g: {"beta": 0.0, "n_votes": 2 * g, "n_train": g}, "TTRL (n_votes = 2 n_train)", "ttrl",
         reward="own", group_size=lambda g: 2 * g, batch_scale=2),
]

# The same comparison with a reference model loaded (KL to the reference): each row against GRPO with `beta` = 0.04
# (the coefficients do not change the cost). The KL-in-reward rows take their sampling log-probs from generation;
# their "forward" twins recompute them with one more no-grad policy forward (`sampling_logps_source="forward"`, what
# every KL-in-reward trainer, TRL's RLOOTrainer included, paid before).
KL = 0.04
_FORWARD = {"sampling_logps_source": "forward"}
ALGOS_REF = [
    Algo("grpo_ref", "GRPO (TRL), beta=0.04", "trl", "GRPOConfig", "GRPOTrainer", lambda g: {"beta": KL},
         baseline="grpo_ref"),
    Algo("trl_rloo_ref", "RLOO (TRL), beta=0.05", "trl", "RLOOConfig", "RLOOTrainer", lambda g: {"beta": 0.05},
         baseline="grpo_ref"),
    ours("rloo_ref", lambda g: {"beta": 0.05}, "RLOO, beta=0.05", "rloo", baseline="grpo_ref", target="kl",
         peer="trl_rloo_ref"),
    ours("rloo_ref_forward", lambda g: {"beta": 0.05, **_FORWARD}, "RLOO, beta=0.05, log-probs by a forward", "rloo",
         baseline="grpo_ref"),
    ours("reinforce_pp_ref", lambda g: {"beta": None}, "REINFORCE++, KL in reward 0.01 (default)", "reinforce_pp",
         baseline="grpo_ref", target="kl"),
    ours("reinforce_pp_ref_forward", lambda g: {"beta": None, **_FORWARD},
         "REINFORCE++, KL in reward 0.01, log-probs by a forward", "reinforce_pp", baseline="grpo_ref"),
    ours("reinforce_pp_baseline_ref", lambda g: {"beta": KL, "kl_in_reward_coef": 0.0, "baseline": True},
         "REINFORCE++-baseline, k2 beta=0.04", "reinforce_pp_baseline", baseline="grpo_ref", target="time"),
    ours("ppo_ref", lambda g: {"critic_backbone": "full"}, "PPO, full critic, KL in reward 0.05 (the default KL)", "ppo",
         baseline="grpo_ref", target="value"),
    ours("ppo_ref_forward", lambda g: dict(_FORWARD, critic_backbone="full"),
         "PPO, full critic, KL in reward 0.05, log-probs by a forward", "ppo", baseline="grpo_ref"),
    # Issue 21: PPO and VAPO at GRPO's memory, with the LoRA critic. PPO's default KL loads the reference model, whose
    # weights the critic shares; VAPO has no KL (no reference model), so its critic's frozen weights are a copy: both
    # against GRPO with a reference model
    ours("ppo_lora_ref", lambda g: {"critic_backbone": "lora"},
         "PPO, LoRA critic (shares the reference), KL in reward 0.05", "ppo", baseline="grpo_ref", target="value_lora"),
    ours("vapo_lora", lambda g: dict(_NO_REF, value_pretrain_steps=1, critic_learning_rate=None,
                                     critic_backbone="lora"),
         "VAPO, LoRA critic (frozen copy)", "vapo", baseline="grpo_ref", target="value_lora"),
]

ALL = {a.name: a for a in ALGOS + ALGOS_REF}


def algorithm_rows() -> list[str]:
    """The GRPO baseline row, then the row of each algorithm of the package as it is (the row named after it), in the
    registry's order: what a benchmark runs by default. An algorithm without a row here is not benchmarked."""
    return ["grpo"] + [name for name in ALGORITHMS if name in ALL]


def target_bound(algo: Algo, group_size: int) -> tuple[str, float] | None:
    """(which ratio of the row is judged, its upper bound), or None for a row without a target."""
    return {
        None: None,
        "time": ("time_ratio", TOLERANCE),
        "kl": ("time_ratio", KL_TOLERANCE),
        "remax": ("time_ratio", 1 + 1 / group_size + 0.05),
        "per_gen_token": ("per_gen_token_ratio", TOLERANCE),
        "dapo": None,  # counts, not timings: no noise interval
        "value": ("time_ratio", 1.8),
        "value_lora": ("time_ratio", 1.8),
    }[algo.target]


def target_check(algo: Algo, row: dict, group_size: int) -> tuple[str, str]:
    """("PASS" | "MISS" | "", the target in words) for a result row holding the ratios."""
    t = row.get("time_ratio")
    if algo.target is None or t is None:
        return "", ""
    if algo.target == "time":
        return ("PASS" if t <= TOLERANCE else "MISS"), f"time <= {TOLERANCE:.2f}x"
    if algo.target == "kl":
        words = f"time <= {KL_TOLERANCE:.2f}x"
        ok = t <= KL_TOLERANCE
        if algo.peer is not None:
            p = row.get("peer_ratio")
            words += f", faster than {ALL[algo.peer].label if algo.peer in ALL else algo.peer}"
            ok = ok and p is not None and p < 1.0
        return ("PASS" if ok else "MISS"), words
    if algo.target == "dapo":
        rounds, gen = row.get("rounds_per_step"), row.get("gen_per_trained_token")
        if rounds is None or gen is None:
            return "", ""
        ok = rounds <= DAPO_MAX_ROUNDS and gen <= DAPO_MAX_GEN_PER_TRAINED
        return ("PASS" if ok else "MISS"), (f"rounds/step <= {DAPO_MAX_ROUNDS}, gen tok / trained tok <= "
                                            f"{DAPO_MAX_GEN_PER_TRAINED}")
    if algo.target == "remax":
        bound = 1 + 1 / group_size + 0.05
        return ("PASS" if t <= bound else "MISS"), f"time <= (1 + 1/G) + 5% = {bound:.2f}x"
    if algo.target == "per_gen_token":
        r = row.get("per_gen_token_ratio")
        if r is None:
            return "", ""
        return ("PASS" if r <= TOLERANCE else "MISS"), f"time per generated token <= {TOLERANCE:.2f}x"
    if algo.target == "value":
        m = row.get("mem_ratio")
        ok = t <= 1.8 and (m is None or m <= 1.6)
        words = "time <= 1.8x, memory <= 1.6x" + ("" if m is not None else " (memory not measured)")
        return ("PASS" if ok else "MISS"), words
    if algo.target == "value_lora":
        m = row.get("mem_ratio")
        if m is None:
            return "", "memory <= 1.15x (not measured)"
        return ("PASS" if t <= 1.8 and m <= 1.15 else "MISS"), "memory <= 1.15x, time <= 1.8x"
    raise ValueError(f"target: unknown kind {algo.target!r}")


# ------------------------------------------------------------------------------------------------ meters
class Meter:
    """Counts what a trainer does, by wrapping three of its (TRL) methods on the instance.

    - generation: every `_generate_single_turn` call (a "round": DAPO refills, ReMax's greedy pass) and the completion
      tokens it returned, with its time;
    - rollout: `_generate_and_score_completions` (generation + rewards + reference/old log-probs + advantages);
    - training: the completion tokens that reached `_compute_loss` (`completion_mask` summed).
    `sync` (e.g. `torch.cuda.synchronize`) makes the timings exact on an asynchronous device.
    """

    def __init__(self, trainer, sync=None):
        self.sync = sync or (lambda: None)
        self.gen_calls = 0
        self.gen_tokens = 0
        self.gen_time = 0.0
        self.rollout_calls = 0
        self.rollout_time = 0.0
        self.trained_tokens = 0
        self._wrap(trainer)

    def _clock(self):
        self.sync()
        return time.perf_counter()

    def _wrap(self, trainer):
        gen = trainer._generate_single_turn
        rollout = trainer._generate_and_score_completions
        loss = trainer._compute_loss

        def generate_single_turn(*args, **kwargs):
            t0 = self._clock()
            out = gen(*args, **kwargs)
            self.gen_time += self._clock() - t0
            ids = out[0] if isinstance(out, tuple) else out  # TRL's GRPO returns (ids, logprobs), its RLOO ids
            self.gen_calls += 1
            self.gen_tokens += int(sum(len(x) for x in ids))
            return out

        def generate_and_score_completions(*args, **kwargs):
            t0 = self._clock()
            out = rollout(*args, **kwargs)
            self.rollout_time += self._clock() - t0
            self.rollout_calls += 1
            return out

        def compute_loss(model, inputs, *args, **kwargs):
            self.trained_tokens += int(inputs["completion_mask"].sum().item())
            return loss(model, inputs, *args, **kwargs)

        trainer._generate_single_turn = generate_single_turn
        trainer._generate_and_score_completions = generate_and_score_completions
        trainer._compute_loss = compute_loss

    def snapshot(self) -> dict:
        return {k: getattr(self, k) for k in
                ("gen_calls", "gen_tokens", "gen_time", "rollout_calls", "rollout_time", "trained_tokens")}


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def machine_description() -> dict:
    """CPU model, cores, library versions and the date, for the results files."""
    import datetime
    import os
    import platform

    import torch
    import transformers

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import trl

        trl_version = trl.__version__
    except Exception:
        trl_version = None
    desc = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl_version,
        "platform": platform.platform(),
    }
    if hasattr(os, "getloadavg"):
        desc["load_average_1min"] = round(os.getloadavg()[0], 2)
    if torch.cuda.is_available():
        desc["gpu"] = torch.cuda.get_device_name(0)
        desc["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        desc["cuda"] = torch.version.cuda
    return desc
