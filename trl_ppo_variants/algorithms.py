"""The one table of algorithms: everything that lists, names or cites an algorithm reads it from here.

Each `Algorithm` says where its config and trainer live, how it is written in prose, what it changes with respect to
GRPO (one line), the papers it reproduces (arXiv id and BibTeX, cited by the model card and the docs), the settings of
the two demos, and what it needs (a critic, its own reward, step rewards). The package's exports, the command line's
subcommands and help, model cards, both demos, the benchmark scripts, TRL's test-suite plugin and the docs' algorithm
table are derived from `ALGORITHMS`; `tests/test_algorithms.py` fails when another module lists the names by hand.

Adding an algorithm is one module under `trainers/` (its config and trainer) plus one entry here (see the docs'
architecture page). This module imports nothing heavy: `import trl_ppo_variants.algorithms` does not load torch.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import textwrap
from dataclasses import dataclass, field

PACKAGE = "trl_ppo_variants"


@dataclass(frozen=True)
class Paper:
    """A paper an algorithm reproduces: how the algorithm is written in prose, the title, the arXiv id, BibTeX."""

    name: str
    title: str
    arxiv_id: str
    bibtex: str

    @property
    def url(self) -> str:
        return f"https://arxiv.org/abs/{self.arxiv_id}"


@dataclass(frozen=True)
class Algorithm:
    """One row of the table.

    `name` is the command-line name (`trl-ppo-variants <name>`), `module` the module under `trl_ppo_variants.trainers`
    that defines `config` and `trainer`, `preset` the (field, value) pairs the name fixes on that config
    (REINFORCE++-baseline is `ReinforcePPConfig` with `baseline=True`: a recipe or the command line may not contradict
    them). `demo` and `toy_demo` are the settings each demo adds to its shared ones (`demo.COMMON`,
    `toy_demo.COMMON`). `baseline` marks the comparison baseline (GRPO), which is a command and an export but not one of
    the algorithms the demos and benchmarks train as "ours".
    """

    name: str
    label: str
    module: str
    config: str
    trainer: str
    summary: str
    paper: Paper
    preset: tuple = ()
    critic: bool = False
    own_reward: bool = False
    step_rewards: bool = False
    baseline: bool = False
    demo: dict = field(default_factory=dict)
    toy_demo: dict = field(default_factory=dict)

    @property
    def module_path(self) -> str:
        return f"{PACKAGE}.trainers.{self.module}"

    @property
    def doc_page(self) -> str:
        """The docs page of the algorithm, relative to `docs/` (REINFORCE++-baseline shares REINFORCE++'s)."""
        return f"algorithms/{self.module}.md"

    def available(self) -> bool:
        """Whether the algorithm's module is installed (finds it without importing it)."""
        try:
            return importlib.util.find_spec(self.module_path) is not None
        except ModuleNotFoundError:
            return False

    def classes(self) -> tuple[type, type]:
        """(config class, trainer class); imports the trainer module."""
        module = importlib.import_module(self.module_path)
        return getattr(module, self.config), getattr(module, self.trainer)


def _bibtex(text: str) -> str:
    return textwrap.dedent(text).strip()


_REINFORCE_PP = Paper(
    name="REINFORCE++",
    title="REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
    arxiv_id="2501.03262",
    bibtex=_bibtex("""
        @article{hu2025reinforce,
            title   = {{REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models}},
            author  = {Jian Hu},
            journal = {arXiv preprint arXiv:2501.03262},
            year    = {2025}
        }"""),
)

_DEEPSEEKMATH = Paper(
    name="GRPO",
    title="DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
    arxiv_id="2402.03300",
    bibtex=_bibtex("""
        @article{shao2024deepseekmath,
            title   = {{DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models}},
            author  = {Zhihong Shao and Peiyi Wang and Qihao Zhu and Runxin Xu and Junxiao Song and Xiao Bi and Haowei Zhang and Mingchuan Zhang and Y. K. Li and Y. Wu and Daya Guo},
            journal = {arXiv preprint arXiv:2402.03300},
            year    = {2024}
        }"""),
)

_ALL = [
    Algorithm(
        "grpo", "GRPO", "grpo", "GRPOConfig", "GRPOTrainer",
        "TRL's GRPOTrainer, the baseline, plus prompt selection (SPEED / GRESO / dynamic sampling)",
        _DEEPSEEKMATH, baseline=True,
    ),
    Algorithm(
        "remax", "ReMax", "remax", "ReMaxConfig", "ReMaxTrainer",
        "baseline: the reward of the greedy completion of the same prompt",
        Paper(
            name="ReMax",
            title="ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning Large Language "
            "Models",
            arxiv_id="2310.10505",
            bibtex=_bibtex("""
                @inproceedings{li2024remax,
                    title     = {{ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning Large Language Models}},
                    author    = {Ziniu Li and Tian Xu and Yushun Zhang and Zhihang Lin and Yang Yu and Ruoyu Sun and Zhi-Quan Luo},
                    booktitle = {Proceedings of the 41st International Conference on Machine Learning (ICML)},
                    year      = {2024},
                    eprint    = {arXiv:2310.10505}
                }"""),
        ),
    ),
    Algorithm(
        "rloo", "RLOO", "rloo", "RLOOConfig", "RLOOTrainer",
        "baseline: the mean reward of the other completions of the prompt (leave-one-out)",
        Paper(
            name="RLOO",
            title="Back to Basics: Revisiting REINFORCE-Style Optimization for Learning from Human Feedback in LLMs",
            arxiv_id="2402.14740",
            bibtex=_bibtex("""
                @inproceedings{ahmadian2024back,
                    title     = {{Back to Basics: Revisiting REINFORCE-Style Optimization for Learning from Human Feedback in LLMs}},
                    author    = {Arash Ahmadian and Chris Cremer and Matthias Gall{\\'{e}} and Marzieh Fadaee and Julia Kreutzer and Olivier Pietquin and Ahmet {\\"{U}}st{\\"{u}}n and Sara Hooker},
                    booktitle = {Proceedings of the 62nd Annual Meeting of the Association for Computational Linguistics (ACL)},
                    year      = {2024},
                    pages     = {12248--12267},
                    eprint    = {arXiv:2402.14740}
                }"""),
        ),
        demo={"beta": 0.0},  # RLOO's beta is a KL penalty in the reward; none, as for the others
        toy_demo={"beta": 0.0},
    ),
    Algorithm(
        "reinforce_pp", "REINFORCE++", "reinforce_pp", "ReinforcePPConfig", "ReinforcePPTrainer",
        "no group baseline: returns with a per-token KL penalty, whitened over the global batch",
        _REINFORCE_PP, preset=(("baseline", False),),
        demo={"kl_in_reward_coef": 0.0},
        toy_demo={"kl_in_reward_coef": 0.0},
    ),
    Algorithm(
        "reinforce_pp_baseline", "REINFORCE++-baseline", "reinforce_pp", "ReinforcePPConfig", "ReinforcePPTrainer",
        "group-mean baseline, then global whitening; k2 KL in the loss",
        dataclasses.replace(_REINFORCE_PP, name="REINFORCE++-baseline"), preset=(("baseline", True),),
        demo={"baseline": True, "beta": 0.0},
        toy_demo={"baseline": True, "beta": 0.0},
    ),
    Algorithm(
        "dapo", "DAPO", "dapo", "DAPOConfig", "DAPOTrainer",
        "clip-higher, dynamic sampling of groups with a reward spread, token-level loss, overlong shaping",
        Paper(
            name="DAPO",
            title="DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
            arxiv_id="2503.14476",
            bibtex=_bibtex("""
                @article{yu2025dapo,
                    title   = {{DAPO: An Open-Source LLM Reinforcement Learning System at Scale}},
                    author  = {Qiying Yu and Zheng Zhang and Ruofei Zhu and Yufeng Yuan and Xiaochen Zuo and Yu Yue and others},
                    journal = {arXiv preprint arXiv:2503.14476},
                    year    = {2025}
                }"""),
        ),
        demo={"max_generation_rounds": 2},
        # the toy's 3-token completions leave the overlong shaping no cache (it would penalise nothing: refused)
        toy_demo={"max_generation_rounds": 2, "overlong_penalty": False},
    ),
    Algorithm(
        "ppo", "PPO", "ppo", "PPOConfig", "PPOTrainer",
        "a learned critic (value model) and GAE advantages per token",
        Paper(
            name="PPO",
            title="Proximal Policy Optimization Algorithms",
            arxiv_id="1707.06347",
            bibtex=_bibtex("""
                @article{schulman2017proximal,
                    title   = {{Proximal Policy Optimization Algorithms}},
                    author  = {John Schulman and Filip Wolski and Prafulla Dhariwal and Alec Radford and Oleg Klimov},
                    journal = {arXiv preprint arXiv:1707.06347},
                    year    = {2017}
                }"""),
        ),
        critic=True,
        # PPO's default critic, the LoRA critic at 10x the policy's rate (3e-4 here): at these settings it gained
        # +0.119 of held-out accuracy on average over seeds 0-3, against +0.021 for the full critic at the policy's
        # rate and +0.094 for trl.GRPOTrainer (bench/critic_learning.py)
        demo={"kl_in_reward_coef": 0.0},
        # the full critic: the toy numbers were measured with it
        toy_demo={"kl_in_reward_coef": 0.0, "critic_backbone": "full", "critic_learning_rate": 3e-3},
    ),
    Algorithm(
        "vapo", "VAPO", "vapo", "VAPOConfig", "VAPOTrainer",
        "PPO with value pre-training, decoupled and length-adaptive GAE, positive-example NLL",
        Paper(
            name="VAPO",
            title="VAPO: Efficient and Reliable Reinforcement Learning for Advanced Reasoning Tasks",
            arxiv_id="2504.05118",
            bibtex=_bibtex("""
                @article{yue2025vapo,
                    title   = {{VAPO: Efficient and Reliable Reinforcement Learning for Advanced Reasoning Tasks}},
                    author  = {Yu Yue and Yufeng Yuan and Qiying Yu and Xiaochen Zuo and Ruofei Zhu and Wenyuan Xu and others},
                    journal = {arXiv preprint arXiv:2504.05118},
                    year    = {2025}
                }"""),
        ),
        critic=True,
        # value pre-training (critic-only steps) comes on top of the policy's steps: every algorithm gets the same
        # number of policy updates
        demo={"value_pretrain_steps": 4},
        # the toy's 2-3 token answers would get VAPO's length-adaptive lambda 1 - 1 / (0.05 * l) < 0, clamped to 0:
        # pure one-step TD on a critic trained for 5 steps. A fixed lam_policy suits answers this short.
        toy_demo={"value_pretrain_steps": 5, "critic_learning_rate": 3e-3, "length_adaptive_alpha": None},
    ),
    Algorithm(
        "ttrl", "TTRL", "ttrl", "TTRLConfig", "TTRLTrainer",
        "label-free: the reward is agreement with the majority vote of the prompt's own samples",
        Paper(
            name="TTRL",
            title="TTRL: Test-Time Reinforcement Learning",
            arxiv_id="2504.16084",
            bibtex=_bibtex("""
                @article{zuo2025ttrl,
                    title   = {{TTRL: Test-Time Reinforcement Learning}},
                    author  = {Yuxin Zuo and Kaiyan Zhang and Li Sheng and Shang Qu and Ganqu Cui and Xuekai Zhu and Haozhan Li and Yuchen Zhang and Xinwei Long and Ermo Hua and Biqing Qi and Youbang Sun and Zhiyuan Ma and Lifan Yuan and Ning Ding and Bowen Zhou},
                    journal = {arXiv preprint arXiv:2504.16084},
                    year    = {2025}
                }"""),
        ),
        own_reward=True,
        # label-free: its reward is the agreement with its own majority vote over 8 samples, 4 of which are trained on
        demo={"n_votes": 8, "n_train": 4, "label_column": "answer", "answer_extractor": "last_number"},
        # at 1e-3 the toy collapses onto wrong majority answers (label accuracy 0.75 -> 0 in 40 steps, measured), the
        # failure mode a label-free method risks with a too-large step
        toy_demo={"n_votes": 8, "n_train": 4, "label_column": "answer", "learning_rate": 1e-4,
                  "answer_extractor": "trl_ppo_variants.toy_demo:first_number"},
    ),
    Algorithm(
        "process_grpo", "GRPO with process supervision", "process_grpo", "ProcessGRPOConfig", "ProcessGRPOTrainer",
        "step rewards normalised per group, summed over the following steps into token advantages",
        dataclasses.replace(_DEEPSEEKMATH, name="GRPO with process supervision"),
        step_rewards=True,
        # a word problem's answer is one step: the task reward as a one-step step reward, where process GRPO's
        # advantage is GRPO's (the multi-step case is tests/test_process_grpo.py's digits task)
    ),
]

#: every command: the baseline (`grpo`) and the algorithms, in the order they are listed to users
REGISTRY: dict[str, Algorithm] = {a.name: a for a in _ALL}
#: this package's algorithms (the baseline excluded): what the demos' `--algo all` and the benchmarks train
ALGORITHMS: dict[str, Algorithm] = {name: a for name, a in REGISTRY.items() if not a.baseline}
#: the comparison baseline
BASELINE: Algorithm = next(a for a in _ALL if a.baseline)


def get(name: str) -> Algorithm | None:
    """The entry of a command name, or None."""
    return REGISTRY.get(name)


def of_trainer(trainer_or_cls, args=None) -> Algorithm | None:
    """The entry of a trainer instance or class (the most derived class of this package in its MRO), or None for a
    trainer of another package. A preset field decides between entries sharing a trainer (`ReinforcePPTrainer` with
    `baseline=True` is REINFORCE++-baseline)."""
    cls = trainer_or_cls if isinstance(trainer_or_cls, type) else type(trainer_or_cls)
    if args is None and not isinstance(trainer_or_cls, type):
        args = getattr(trainer_or_cls, "args", None)
    for klass in cls.__mro__:
        if not klass.__module__.startswith(f"{PACKAGE}.trainers."):
            continue
        matches = [a for a in _ALL if a.trainer == klass.__name__ and klass.__module__ == a.module_path]
        for entry in matches:
            if all(getattr(args, k, None) == v for k, v in entry.preset):
                return entry
        if matches:
            return matches[0]
    return None


def installed() -> list[str]:
    """The names of `ALGORITHMS` whose modules are installed, in their order."""
    return [name for name, a in ALGORITHMS.items() if a.available()]


def parse_algorithm_list(spec: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The demos' `--algo`: `"all"` (every installed algorithm, after `extra`, e.g. the demo's `grpo` reference) or
    comma-separated names, each one of `extra` or an installed algorithm; ValueError (one line) otherwise."""
    if spec.strip() == "all":
        return [*extra, *installed()]
    names = [s.strip() for s in spec.split(",") if s.strip()]
    known = [*extra, *ALGORITHMS]
    if not names:
        raise ValueError(f"no algorithm named: expected 'all' or one or more of {', '.join(known)}")
    for name in names:
        if name not in known:
            raise ValueError(f"unknown algorithm '{name}': expected 'all' or one or more of {', '.join(known)}")
        if name not in extra and not ALGORITHMS[name].available():
            raise ValueError(f"algorithm '{name}' is not installed")
    return names


def exports() -> dict[str, str]:
    """Public class name -> module under `trl_ppo_variants` that defines it (the package's lazy exports)."""
    out = {"VariantConfig": "trainers.base", "VariantTrainer": "trainers.base"}
    for a in _ALL:
        out.setdefault(a.config, f"trainers.{a.module}")
        out.setdefault(a.trainer, f"trainers.{a.module}")
    return out
