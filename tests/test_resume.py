"""Resume reproduces the uninterrupted run exactly, for every trainer of the package (issue 7, point 1).

Protocol: run A trains N=4 steps with a checkpoint every k=3 steps; run B trains the same configuration, stops after
step 3 (its checkpoint written), and a fresh trainer (fresh model object) resumes it with
`resume_from_checkpoint=True` and finishes. On CPU with a fixed seed every logged metric after the resume (losses,
rewards, advantages' statistics, KL, ...; not wall-clock times) and every final weight (policy and critic) must be
*equal*, with `steps_per_generation` 1 and 2 (with 2, step 3 is the first half of a generation block: the resumed run
must train step 4 on the buffered second half, not regenerate).

Exactness holds because nothing random is left to chance: the RNG states (transformers), the generation buffer and
its counter (checkpointing.py), the sampler's epoch order (checkpointing.resumable_sampler) and each trainer's own
state (`extra_state`) are restored, and CPU kernels are deterministic for a fixed thread count.
"""

import glob
import os

import pytest
import torch
from reliability_helpers import StopAt, available_specs, make_trainer, modules_state, step_logs

TOTAL, STOP = 4, 3


def _assert_same_run(full, resumed, after_step):
    logs_a, logs_b = step_logs(full), step_logs(resumed)
    compared = [s for s in logs_a if s > after_step]
    assert compared, "nothing was logged after the resume point"
    for step in compared:
        assert logs_b.get(step) == logs_a[step], f"step {step}: logs differ"
    wa, wb = modules_state(full), modules_state(resumed)
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"weights differ after resume: {different[:5]}"


def _full_and_resumed(name, toy_model_dir, tmp_path, **overrides):
    common = dict(max_steps=TOTAL, save_strategy="steps", save_steps=STOP, **overrides)
    full = make_trainer(name, toy_model_dir, tmp_path, "full", **common)
    full.train()
    stopped = make_trainer(name, toy_model_dir, tmp_path, "stopped", callbacks=[StopAt(STOP)], **common)
    stopped.train()
    assert stopped.state.global_step == STOP
    resumed = make_trainer(name, toy_model_dir, tmp_path, "stopped", **common)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == TOTAL
    return full, resumed


@pytest.mark.timeout(300)
@pytest.mark.parametrize("steps_per_generation", [1, 2])
@pytest.mark.parametrize("name", available_specs())
def test_resume_is_exact(name, steps_per_generation, toy_model_dir, tmp_path):
    full, resumed = _full_and_resumed(name, toy_model_dir, tmp_path, steps_per_generation=steps_per_generation)
    _assert_same_run(full, resumed, STOP)


@pytest.mark.timeout(300)
def test_resume_without_our_state_is_not_exact(toy_model_dir, tmp_path):
    """Negative control: the same protocol with the generation buffer file removed from the checkpoint (what TRL's
    GRPOTrainer saves) regenerates step 4's batch and ends elsewhere; so the exact test above can fail."""
    common = dict(max_steps=TOTAL, save_strategy="steps", save_steps=STOP, steps_per_generation=2)
    full = make_trainer("rloo", toy_model_dir, tmp_path, "full", **common)
    full.train()
    make_trainer("rloo", toy_model_dir, tmp_path, "stopped", callbacks=[StopAt(STOP)], **common).train()
    for path in glob.glob(str(tmp_path / "stopped" / "checkpoint-*" / "variant_state_rank*.pt")):
        os.remove(path)
    resumed = make_trainer("rloo", toy_model_dir, tmp_path, "stopped", **common)
    with pytest.warns(UserWarning, match="holds no generation buffer"):
        resumed.train(resume_from_checkpoint=True)
    wa, wb = modules_state(full), modules_state(resumed)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) > 1e-5


@pytest.mark.timeout(300)
def test_resume_in_a_later_epoch_is_exact(toy_model_dir, tmp_path):
    """8 prompts, 2 per step: 4 steps per epoch; checkpoint at step 5 (epoch 1). TRL's sampler would replay epoch 0's
    order after the resume (measured 5e-4 on the final weights); ours draws epoch 1's."""
    from trl_ppo_variants.toy import addition_dataset

    common = dict(max_steps=7, save_strategy="steps", save_steps=5, dataset=addition_dataset(8, seed=0))
    full = make_trainer("rloo", toy_model_dir, tmp_path, "full", **common)
    full.train()
    make_trainer("rloo", toy_model_dir, tmp_path, "stopped", callbacks=[StopAt(5)], **common).train()
    resumed = make_trainer("rloo", toy_model_dir, tmp_path, "stopped", **common)
    resumed.train(resume_from_checkpoint=True)
    _assert_same_run(full, resumed, 5)


def test_resumable_sampler_draws_trl_order():
    """Epoch e of our sampler = TRL's RepeatSampler's (e+1)-th pass, whatever passes came before."""
    from trl.trainer.utils import RepeatSampler

    from trl_ppo_variants.checkpointing import resumable_sampler

    class FakeTrainer:
        class state:
            epoch = 0.0

    trainer = FakeTrainer()
    data = list(range(10))
    trl_sampler = RepeatSampler(data, mini_repeat_count=2, batch_size=2, repeat_count=2, shuffle=True, seed=3)
    trl_passes = [list(trl_sampler) for _ in range(3)]
    ours = resumable_sampler(RepeatSampler(data, mini_repeat_count=2, batch_size=2, repeat_count=2, seed=3), trainer)
    for epoch in (2, 0, 1, 2):  # out of order: no dependence on earlier passes
        trainer.state.epoch = epoch + 0.5
        assert list(ours) == trl_passes[epoch]
    assert len(ours) == len(trl_sampler)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, field", [("vapo", "value_pretrain_steps"), ("ppo", "critic_warmup_steps")])
def test_resume_during_critic_warmup_is_exact(name, field, toy_model_dir, tmp_path):
    """A checkpoint in the middle of the critic warm-up (VAPO's value pre-training; PPO's `critic_warmup_steps`, the
    same mechanism): step 3 of 4 warm-up steps, 6 in all, with the policy's warm-up schedule starting at step 4.
    The resumed run warms the critic up exactly one more step, then trains the policy on the same schedule, and ends
    equal to the uninterrupted run."""
    if name not in available_specs():
        pytest.fail(f"the {name} trainer is missing")
    common = dict(max_steps=6, save_strategy="steps", save_steps=STOP, warmup_steps=1, **{field: 4})
    full = make_trainer(name, toy_model_dir, tmp_path, "full", **common)
    full.train()
    stopped = make_trainer(name, toy_model_dir, tmp_path, "stopped", callbacks=[StopAt(STOP)], **common)
    stopped.train()
    assert stopped.state.global_step == STOP
    resumed = make_trainer(name, toy_model_dir, tmp_path, "stopped", **common)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    _assert_same_run(full, resumed, STOP)
    # the rate each step ran with: steps 1-4 warm the critic up, step 5 is the policy's first (its own warm-up step)
    rates = [step_logs(resumed)[s]["learning_rate"] for s in range(4, 7)]
    assert rates == pytest.approx([0.0, 0.0, 1e-3])


# --------------------------------------------------------------------------------------------- mixture-of-experts
#: the tiny Qwen3-MoE's tensors (`toy.build_model(num_experts=4)`): per layer 4 attention projections, 2 norms of
#: queries and keys, 2 layer norms, the router and the two fused expert tensors; embeddings, final norm, tied head
MOE_TENSORS = 2 * 11 + 3


@pytest.fixture(scope="module")
def toy_moe_dir(tmp_path_factory):
    """A tiny Qwen3-MoE (4 experts, 2 routed per token) warm-started on the toy task: right on 20% of the prompts."""
    from trl_ppo_variants.toy import make_toy_checkpoint

    return make_toy_checkpoint(str(tmp_path_factory.mktemp("toy_moe")), seed=0, warm_steps=10, num_experts=4)


def _assert_every_tensor_trained(trainer, initial: dict, expected: int):
    """`trainer`'s policy has `expected` tensors, fused experts among them, and training moved every one of them
    from `initial`: a tensor a resume leaves at its initial value cannot match the uninterrupted run."""
    state = trainer.model.state_dict()
    assert len(state) == expected and state.keys() == initial.keys()
    assert [k for k in state if k.endswith("experts.gate_up_proj")] and [k for k in state
                                                                        if k.endswith("experts.down_proj")]
    assert not [k for k in state if torch.equal(state[k], initial[k])], "tensors not trained"


@pytest.mark.timeout(300)
def test_resume_of_an_moe_policy_restores_every_tensor(toy_moe_dir, tmp_path):
    """transformers saves an MoE's fused experts as one tensor per expert; the resume converted the checkpoint's keys
    with (1,)-shaped markers, which the expert split refused (`IndexError: Dimension out of range`), and TRL's own
    resume restores 23 of the 25 tensors (the experts keep their initial values). Every tensor comes back now: the
    resumed run ends equal to the uninterrupted one, tensor by tensor."""
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(toy_moe_dir).state_dict()
    full, resumed = _full_and_resumed("grpo", toy_moe_dir, tmp_path)
    _assert_every_tensor_trained(full, initial, MOE_TENSORS)
    _assert_same_run(full, resumed, STOP)


@pytest.mark.timeout(300)
def test_resume_of_an_moe_vlm_restores_every_tensor(tmp_path):
    """The same with the tiny Qwen3.5-MoE vision-language model (linear attention, fused experts, a vision tower)."""
    from transformers import AutoModelForImageTextToText

    from trl_ppo_variants.toy_vlm import color_reward, make_tiny_vlm, toy_vlm_dataset

    model_dir = make_tiny_vlm(str(tmp_path / "qwen3_5_moe"), "qwen3_5_moe", seed=0)
    initial = AutoModelForImageTextToText.from_pretrained(model_dir).state_dict()
    full, resumed = _full_and_resumed("grpo", model_dir, tmp_path, reward=[color_reward], dataset=toy_vlm_dataset(16),
                                      per_device_train_batch_size=4, bf16=False)
    _assert_every_tensor_trained(full, initial, len(initial))
    _assert_same_run(full, resumed, STOP)


def _bonus_at_step_1(completions, answer, trainer_state=None, **kwargs):
    """addition_reward plus 10 at global step 1 (training and evaluation alike): the same shift for a whole group
    changes no advantage, and the evaluation at step 1 scores best."""
    from trl_ppo_variants.toy import addition_reward

    bonus = 10.0 if trainer_state.global_step == 1 else 0.0
    return [r + bonus for r in addition_reward(completions, answer)]


@pytest.mark.timeout(300)
def test_load_best_model_at_end_with_an_moe_policy(toy_moe_dir, tmp_path):
    """`load_best_model_at_end=True` died at the end of `train()` with an MoE policy (the key conversion's
    IndexError). Now the policy ends with the best checkpoint's tensors, every one (compared with that checkpoint
    read by transformers' own `from_pretrained`), not the last step's."""
    from transformers import AutoModelForCausalLM

    from trl_ppo_variants.toy import addition_dataset

    trainer = make_trainer("grpo", toy_moe_dir, tmp_path, "best", reward=[_bonus_at_step_1], max_steps=3,
                           save_strategy="steps", save_steps=1, eval_strategy="steps", eval_steps=1,
                           per_device_eval_batch_size=8, eval_dataset=addition_dataset(8, seed=1),
                           load_best_model_at_end=True, metric_for_best_model="reward", greater_is_better=True)
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best.endswith("checkpoint-1"), best
    state = trainer.model.state_dict()
    saved = AutoModelForCausalLM.from_pretrained(best).state_dict()
    last = AutoModelForCausalLM.from_pretrained(str(tmp_path / "best" / "checkpoint-3")).state_dict()
    assert len(state) == MOE_TENSORS and state.keys() == saved.keys()
    assert not [k for k in state if not torch.equal(state[k], saved[k])]
    assert not [k for k in state if torch.equal(state[k], last[k])]  # every tensor moved after the best step


class _Loader:
    """What `checkpointing.load_model_weights` needs of a trainer."""

    def __init__(self):
        self.results = []

    def _issue_warnings_after_load(self, result):
        self.results.append(result)


def test_sharded_moe_checkpoint_loads_every_tensor_and_a_missing_expert_is_refused(tmp_path):
    """A checkpoint in shards whose boundaries cut through a layer's experts (each expert of a fused tensor read from
    its own shard) loads into another copy of the model with every tensor equal; a checkpoint that lacks one expert
    is refused in one line instead of leaving that fused tensor as it was."""
    import json

    from safetensors.torch import load_file, save_file

    from trl_ppo_variants.checkpointing import load_model_weights
    from trl_ppo_variants.toy import build_model, build_tokenizer

    tok = build_tokenizer()
    saved = build_model(tok, seed=0, num_experts=4)
    saved.save_pretrained(tmp_path / "ckpt", max_shard_size="40KB")
    with open(tmp_path / "ckpt" / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    layer0 = {weight_map[f"model.layers.0.mlp.experts.{e}.{part}.weight"] for e in range(4)
              for part in ("gate_proj", "up_proj")}
    assert len(layer0) > 1  # the experts of one fused tensor come from several files
    loader, model = _Loader(), build_model(tok, seed=1, num_experts=4)
    assert load_model_weights(loader, model, str(tmp_path / "ckpt"))
    want, got = saved.state_dict(), model.state_dict()
    assert len(got) == MOE_TENSORS and got.keys() == want.keys()
    assert not [k for k in want if not torch.equal(got[k], want[k])]
    # the tied head is never saved: the model's own `_issue_warnings_after_load` leaves it out
    assert loader.results[0].unexpected_keys == [] and loader.results[0].missing_keys == ["lm_head.weight"]

    def drop(keys):
        for shard in {weight_map[k] for k in keys}:
            path = str(tmp_path / "ckpt" / shard)
            save_file({k: v for k, v in load_file(path).items() if k not in keys}, path, metadata={"format": "pt"})
        for k in keys:
            weight_map.pop(k)
        with open(tmp_path / "ckpt" / "model.safetensors.index.json", "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)

    fresh = build_model(tok, seed=2, num_experts=4)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    drop(["model.layers.1.mlp.experts.2.down_proj.weight"])  # one expert of a fused tensor
    with pytest.raises(ValueError, match=r"^checkpoint .*: expected model\.layers\.1\.mlp\.experts\.down_proj of "
                                         r"shape \(4, 64, 64\), got \(3, 64, 64\)"):
        load_model_weights(_Loader(), fresh, str(tmp_path / "ckpt"))
    drop([f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in (0, 1, 3)])  # the whole fused tensor
    with pytest.raises(ValueError, match=r"^checkpoint .*: expected every trained weight of the model, 1 missing "
                                         r"\(model\.layers\.1\.mlp\.experts\.down_proj\)"):
        load_model_weights(_Loader(), fresh, str(tmp_path / "ckpt"))
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())  # nothing was loaded


def test_weights_in_another_dtype_come_back_unrounded(tmp_path):
    """The loader casts each saved tensor to the dtype of the tensor it fills: a head kept in a wider dtype than the
    rest (what `cast_lm_head_to_fp32` does to a bf16 model) is filled in its own, bit for bit."""
    from trl_ppo_variants.checkpointing import load_model_weights
    from trl_ppo_variants.toy import build_model, build_tokenizer

    tok = build_tokenizer()
    saved = build_model(tok, seed=0, num_experts=4, tie_word_embeddings=False)
    saved.lm_head.to(torch.float64)
    with torch.no_grad():
        saved.lm_head.weight.add_(1e-12)  # not representable in fp32
    saved.save_pretrained(tmp_path / "ckpt")
    model = build_model(tok, seed=1, num_experts=4, tie_word_embeddings=False)
    model.lm_head.to(torch.float64)
    assert load_model_weights(_Loader(), model, str(tmp_path / "ckpt"))
    assert model.lm_head.weight.dtype == torch.float64
    assert not [k for k, v in saved.state_dict().items() if not torch.equal(model.state_dict()[k], v)]


# --------------------------------------------------------------------------------------------- another process count
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_processes_resume_a_one_process_checkpoint_with_its_global_state(toy_model_dir, tmp_path, machines):
    """The scoring tally and the prompt selection's state (GRESO history and exploration, keep-rate estimate, refill
    position) are the run's, the same on every process: a 1-process checkpoint resumed by 2 processes gives both the
    saved values (were one process to start from zeros, the ranks would stop on unscorable batches at different
    steps: a hang). Only the generation buffer is per process; the warning says it is regenerated.
    Script: tests/scripts/resume_2proc.py."""
    import json
    import subprocess
    import sys

    from launcher import ROOT, SCRIPTS, accelerate_launch, launch_env

    script = SCRIPTS / "resume_2proc.py"
    saved = subprocess.run([sys.executable, str(script), toy_model_dir, str(tmp_path), "save"], cwd=ROOT,
                           env=launch_env(), capture_output=True, text=True, timeout=300)
    assert saved.returncode == 0, saved.stderr[-4000:]
    state = torch.load(tmp_path / "save" / "checkpoint-2" / "variant_state_rank0.pt", weights_only=False)
    assert state["world_size"] == 1
    tally = state["scoring_tally"]
    assert tally["batches"] >= 2 and 0 < tally["unscorable_completions"] < tally["completions"], tally
    selection = json.loads(json.dumps(state["extra"]["prompt_selection"]))  # as the script writes it
    assert selection["history"] and selection["keep_rate"] != [0.0, 0.0] and selection["source"]["offset"] > 0

    accelerate_launch("resume_2proc.py", toy_model_dir, tmp_path, "resume", marker="RESUME-2PROC-OK",
                      machines=machines)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(ranks):
        restored = result["restored"]
        assert (result["world_size"], restored["global_step"]) == (2, 2), rank
        assert restored["scoring_tally"] == tally, f"rank {rank}: scoring tally"
        assert restored["prompt_selection"] == selection, f"rank {rank}: prompt selection state"
        lost = [w for w in result["warnings"] if "written by 1 process" in w]
        assert len(lost) == 1 and "generation buffer" in lost[0], result["warnings"]
    # the step after the resume counted on both from the same start, hence the same
    assert ranks[0]["end"] == ranks[1]["end"] and ranks[0]["end"]["global_step"] == 3
    assert ranks[0]["end"]["scoring_tally"]["batches"] > tally["batches"]
