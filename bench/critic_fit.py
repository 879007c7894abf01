"""How fast each critic fits Monte-Carlo returns on the real model, away from any policy update (issue 28 item 5).

SmolLM2-135M-Instruct samples a fixed set of rollouts of the demo's task (2-digit word problems, temperature 0.7, 24
new tokens, 4 samples per question); each token's target is its completion's outcome reward (MC return: gamma = lam
= 1, no KL). A fresh critic (`critic.build_critic`, the trainers' constructor: new head, same init) is then trained
with Adam on the training rollouts, 16 a step as in the demo, on the plain token-mean squared error, and evaluated on
held-out rollouts of other questions after every step:

- `mse`: held-out squared error of the values against the returns; `mse_const`: that of the best constant (the
  training returns' mean), so `mse < mse_const` means the critic predicts something the mean does not;
- `ev`: held-out explained variance `1 - Var(R - V) / Var(R)` (the trainers' `value/explained_variance`);
- `value_std`: spread of the held-out values; `delta_std`: spread of their change in that step (how far one step
  moves the value function).

The loss's scale (`vf_coef`, the token normaliser) drops out of Adam's update (it divides the gradient by its own
running RMS), so the learning rate and the trained parameters are what differ between the rows.

    python bench/critic_fit.py [--seed 0] [--configs full@3e-5,full@3e-6,lora@3e-4] [--steps 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from trl_ppo_variants.toy import use_offline_env  # noqa: E402

use_offline_env(DS_ACCELERATOR="cpu", TRANSFORMERS_VERBOSITY="error")

DEFAULT_OUT = os.path.join(HERE, "results", "smollm2_critic")


def rollouts(model, tokenizer, questions: int, samples: int, seed: int, split: str):
    """(input_ids, attention_mask, completion_mask, returns) of `questions` x `samples` sampled completions."""
    import torch

    from trl_ppo_variants.smollm2 import word_problem_dataset, word_problem_reward

    data = word_problem_dataset(questions, seed=seed, split=split)
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in data["prompt"]]
    jobs = [(t, a) for t, a in zip(texts, data["answer"]) for _ in range(samples)]
    enc = tokenizer([t for t, _ in jobs], return_tensors="pt", padding=True, padding_side="left",
                    add_special_tokens=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=24, do_sample=True, temperature=0.7, top_k=0, top_p=1.0,
                             pad_token_id=tokenizer.pad_token_id)
    completion = out[:, enc["input_ids"].shape[1]:]
    is_eos = completion == tokenizer.eos_token_id
    # the completion's tokens up to and including its first EOS (as TRL's completion_mask)
    after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0
    completion_mask = (~after_eos).long()
    texts_out = tokenizer.batch_decode(completion, skip_special_tokens=True)
    reward = torch.tensor([float(r or 0.0) for r in word_problem_reward(texts_out, answer=[a for _, a in jobs])])
    attention = torch.cat([enc["attention_mask"], completion_mask], dim=1)
    returns = reward.unsqueeze(1) * completion_mask
    return out, attention, completion_mask, returns


def fit(policy, data_train, data_test, backbone: str, lr: float, steps: int, seed: int,
        batch: int = 16) -> list[dict]:
    import torch

    from trl_ppo_variants.critic import build_critic, critic_values

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        critic = build_critic(policy, critic_backbone=backbone)
    params = [p for p in critic.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    ids_tr, att_tr, mask_tr, ret_tr = data_train
    ids_te, att_te, mask_te, ret_te = data_test
    width = mask_tr.shape[1]
    m_te = mask_te.bool()
    const = ret_tr[mask_tr.bool()].mean()

    def evaluate(previous):
        critic.eval()
        with torch.no_grad():
            values = critic_values(critic, ids_te, att_te, width, batch_size=32)[m_te]
        critic.train()
        target = ret_te[m_te]
        var = target.var()
        row = {"mse": ((values - target) ** 2).mean().item(), "mse_const": ((const - target) ** 2).mean().item(),
               "ev": (1 - (target - values).var() / var).item() if var > 0 else None,
               "value_mean": values.mean().item(), "value_std": values.std().item(),
               "delta_std": None if previous is None else (values - previous).std().item()}
        return row, values

    row, values = evaluate(None)
    history = [{"step": 0, **row}]
    order = torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):
        rows = torch.randperm(ids_tr.shape[0], generator=order)[:batch]
        values_tr = critic_values(critic, ids_tr[rows], att_tr[rows], width)
        m = mask_tr[rows].bool()
        loss = ((values_tr - ret_tr[rows]) ** 2)[m].mean()
        optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, float("inf")).item()
        optimizer.step()
        row, values = evaluate(values)
        history.append({"step": step, "train_loss": loss.item(), "grad_norm": grad_norm, **row})
        print(f"  {backbone}@{lr:g} step {step}: held-out mse {row['mse']:.4f} (constant {row['mse_const']:.4f}), "
              f"ev {row['ev']:.3f}, value std {row['value_std']:.3f}, step's change std {row['delta_std']:.3f}, "
              f"grad norm {grad_norm:.3g}", flush=True)
    del critic, optimizer
    return history


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", default="full@3e-5,full@3e-6,lora@3e-4")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--out", default=DEFAULT_OUT)
    opts = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_ppo_variants.smollm2 import smollm2_checkpoint

    model_dir = smollm2_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy.eval()
    start = time.perf_counter()
    train = rollouts(policy, tokenizer, opts.questions, 4, opts.seed + 1000, "train")
    test = rollouts(policy, tokenizer, opts.questions, 4, opts.seed, "test")
    print(f"rollouts: train accuracy {train[3].max(1).values.mean():.3f}, held-out {test[3].max(1).values.mean():.3f}"
          f" ({time.perf_counter() - start:.0f} s)", flush=True)
    os.makedirs(opts.out, exist_ok=True)
    path = os.path.join(opts.out, "critic_fit.json")
    results = json.load(open(path)) if os.path.exists(path) else {"runs": {}}
    results["settings"] = {"questions": opts.questions, "samples": 4, "batch": 16, "steps": opts.steps,
                           "optimizer": "AdamW, weight decay 0, no clipping", "loss": "token-mean squared error",
                           "threads": torch.get_num_threads()}
    for config in opts.configs.split(","):
        backbone, lr = config.split("@")
        key = f"{config}/{opts.seed}"
        if key in results["runs"]:
            continue
        print(f"{key}", flush=True)
        results["runs"][key] = {"backbone": backbone, "lr": float(lr), "seed": opts.seed,
                                "train_accuracy": train[3].max(1).values.mean().item(),
                                "heldout_accuracy": test[3].max(1).values.mean().item(),
                                "date": time.strftime("%Y-%m-%d", time.gmtime()),
                                "history": fit(policy, train, test, backbone, float(lr), opts.steps, opts.seed)}
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    run()
