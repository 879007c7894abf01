"""tests/launcher.py's two-machine mode: the commands are the multi-node recipe of docs/how-to/distributed.md (two
`accelerate launch`, one per machine rank, on the loopback), the DeepSpeed config is the shipped multi-node recipe
sized down, and a launch that hangs is killed with every process of both machines. The two-machine runs of the
trainers are the 2-process tests' own (their `machines` parameter; `make test-multinode`)."""

import re

import psutil
import pytest
import yaml
from launcher import MULTI_NODE_RECIPE, ROOT, accelerate_launch, launch_command, multi_node_config

DOCS = ROOT / "docs" / "how-to" / "distributed.md"


def _flags(cmd) -> dict:
    return {a: b for a, b in zip(cmd, cmd[1:]) if a.startswith("--")}


def test_two_machine_commands_are_the_documented_recipe():
    """The launcher's commands for machines 0 and 1 differ in the rank only, and are the docs' CPU command (its flags
    and values) but for the port, which the test picks."""
    cmds = [launch_command("finish_2proc.py", machines=2, machine_rank=m, port=29500) for m in (0, 1)]
    for rank, cmd in enumerate(cmds):
        flags = _flags(cmd)
        assert "--multi_gpu" in cmd and "--cpu" not in cmd  # --cpu would start one process
        assert (flags["--num_machines"], flags["--machine_rank"], flags["--num_processes"]) == ("2", str(rank), "2")
        assert (flags["--main_process_ip"], flags["--main_process_port"]) == ("127.0.0.1", "29500")
    assert [a for a in cmds[0] if a != "0"] == [a for a in cmds[1] if a != "1"]
    text = DOCS.read_text().replace("\\\n", " ")
    documented = [c for c in re.findall(r"accelerate launch (.*?) -m trl_ppo_variants", text) if "127.0.0.1" in c]
    assert len(documented) == 1, documented
    assert _flags(documented[0].split()) == _flags(cmds[0]) and "--multi_gpu" in documented[0].split()


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_runs_the_shipped_multi_node_recipe_sized_down(tmp_path, stage):
    test_config = ROOT / "tests" / "configs" / f"critic_zero{stage}.yaml"
    config = yaml.safe_load(multi_node_config(test_config, tmp_path).read_text())
    shipped = yaml.safe_load(MULTI_NODE_RECIPE.read_text())
    own = yaml.safe_load(test_config.read_text())["deepspeed_config"]
    assert (config["num_machines"], config["num_processes"], config["mixed_precision"]) == (2, 2, "no")
    assert config["main_process_ip"] == "127.0.0.1" and config["distributed_type"] == "DEEPSPEED"
    # without the standard launcher accelerate would start DeepSpeed's pdsh runner over ssh
    assert config["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"
    assert config["deepspeed_config"] == {**shipped["deepspeed_config"], **own}
    assert config["deepspeed_config"]["zero_stage"] == stage
    for key in ("rdzv_backend", "same_network", "compute_environment"):
        assert config[key] == shipped[key], key


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hung_two_machine_launch_is_killed_with_every_process(tmp_path):
    """Both machines' workers joined the group, then hang (one in a collective, one asleep): at the timeout both
    launchers and their workers are gone, and the failure says so for each machine."""
    proc = accelerate_launch("hold_2proc.py", tmp_path, machines=2, timeout=90, check=False)
    assert proc.returncode != 0
    for machine in (0, 1):
        assert f"machine {machine} killed with every process it started after 90 s" in proc.stderr, proc.stderr
    assert [(tmp_path / f"joined_rank{r}").read_text() for r in (0, 1)] == ["2", "2"], proc.stderr[-3000:]
    pids = [int((tmp_path / f"pid_rank{r}").read_text()) for r in (0, 1)]
    assert not [pid for pid in pids if _running(pid)], "a worker outlived its killed launcher"


def _running(pid) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
