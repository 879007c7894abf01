"""A checkpoint written by one process, resumed by two (tests/test_resume.py runs both).

The run: the package's GRPO with GRESO selection on the toy task, a reward that leaves the prompts starting with "1"
unscored, 2 steps of a generation batch of 8 completions.

- `save` (plain `python`, one process, 8 rows): trains the 2 steps and writes OUT_DIR/save/checkpoint-2.
- `resume` (`accelerate launch --num_processes 2`, 4 rows per process: the same generation batch) resumes from that
  checkpoint and trains one more step. Each process writes OUT_DIR/rank{r}.json: its scoring tally and its prompt
  selection's state (`PromptSelection.state_dict`) as restored (at `on_train_begin`, which transformers calls after
  loading the checkpoint) and at the end, and the warnings it got.

Usage: resume_2proc.py MODEL_DIR OUT_DIR save|resume
"""

import json
import os
import sys
import warnings

from _common import main_then_finish, model_and_out_dirs, toy_args


STEPS = 2
SETTINGS = dict(max_steps=STEPS, num_generations=4, prompt_selection="greso", max_generation_rounds=3,
                temperature=1.5)


def half_scorable(completions, prompts, answer, **kwargs):
    """The toy reward, None (unscorable) for the prompts that start with "1": the tally counts some of each."""
    from trl_ppo_variants.toy import addition_reward

    real = addition_reward(completions, answer)
    return [None if p.startswith("1") else r for r, p in zip(real, prompts)]


def run_state(trainer) -> dict:
    """The run's state a process holds (JSON-able, compared across processes and with the checkpoint)."""
    return json.loads(json.dumps({"scoring_tally": trainer.scoring_tally,
                                  "prompt_selection": trainer.prompt_selection.state_dict()}))


def main():
    from transformers import TrainerCallback

    from trl_ppo_variants.toy import addition_dataset
    from trl_ppo_variants.trainers.grpo import GRPOConfig, GRPOTrainer

    model_dir, out_dir = model_and_out_dirs()
    data = addition_dataset(64, seed=0)
    if sys.argv[3] == "save":
        args = toy_args(GRPOConfig, out_dir, output_dir=os.path.join(out_dir, "save"), per_device_train_batch_size=8,
                        save_strategy="steps", save_steps=STEPS, **SETTINGS)
        GRPOTrainer(model_dir, half_scorable, args=args, train_dataset=data).train()
        return
    checkpoint = os.path.join(out_dir, "save", f"checkpoint-{STEPS}")
    args = toy_args(GRPOConfig, out_dir, per_device_train_batch_size=4, **{**SETTINGS, "max_steps": STEPS + 1})
    restored = {}

    class Restored(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            restored.update(global_step=state.global_step, **run_state(trainer))

    trainer = GRPOTrainer(model_dir, half_scorable, args=args, train_dataset=data, callbacks=[Restored()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=checkpoint)
    rank = trainer.accelerator.process_index
    result = {"world_size": trainer.accelerator.num_processes, "restored": restored,
              "end": {"global_step": trainer.state.global_step, **run_state(trainer)},
              "warnings": [str(w.message) for w in caught]}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    trainer.accelerator.wait_for_everyone()
    if trainer.accelerator.is_main_process:
        print("RESUME-2PROC-OK")


if __name__ == "__main__":
    main_then_finish(main)
