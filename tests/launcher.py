"""The one way the tests start several processes: `accelerate launch` on CPU, for the scripts in tests/scripts/ and
for the CLI (`-m trl_ppo_variants`).

Every launch gets a free port at run time (`--main_process_port 0`: accelerate binds port 0 and takes what the system
gives), so tests that launch can run at the same time, under pytest-xdist or from two checkouts, and none owns a
fixed port. The environment is the same for all: one thread per process, no GPU (a test must run the CPU path on a
machine that has one), offline, the checkout's own package first on PYTHONPATH (the scripts find the tests'
helpers through tests/scripts/_common.py). A failure is
one assertion whose message has the command, the exit status and the tails of stdout and stderr; a launch that runs
past its timeout is killed with every process it started (the workers too, not only the launcher).

DeepSpeed configs run without ACCELERATE_USE_CPU: accelerate turns DeepSpeed off when it is set, and
CUDA_VISIBLE_DEVICES="" already keeps DeepSpeed on CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
ACCELERATE = Path(sys.executable).with_name("accelerate")

# what a port taken between accelerate's choice and torch's bind looks like (another launch, at the same moment)
_PORT_TAKEN = ("EADDRINUSE", "address already in use", "another process is utilizing it")


def launch_env(unset=(), **overrides) -> dict[str, str]:
    """The environment of a launched process: this one's, minus `unset`, with the shared settings and `overrides`."""
    env = {k: v for k, v in os.environ.items() if k not in unset}
    path = [str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", ACCELERATE_USE_CPU="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(dict.fromkeys(path)))
    env.update(overrides)
    return env


def _is_deepspeed(config_file) -> bool:
    with open(config_file) as f:
        return (yaml.safe_load(f) or {}).get("distributed_type") == "DEEPSPEED"


def launch_command(target, *args, config_file=None, module=False, num_processes=2) -> list[str]:
    """`accelerate launch` of `target` (a script of tests/scripts/, or a module with `module=True`) on a free port.
    Without `config_file`: DDP over gloo (`--multi_gpu`; `--cpu` would start one process)."""
    cmd = [str(ACCELERATE), "launch"]
    if config_file is not None:
        cmd += ["--config_file", str(config_file)]
    if config_file is None or not _is_deepspeed(config_file):
        cmd.append("--multi_gpu")
    cmd += ["--num_processes", str(num_processes), "--num_machines", "1", "--mixed_precision", "no",
            "--main_process_port", "0"]
    cmd += ["-m", target] if module else [str(SCRIPTS / target)]
    return cmd + [str(a) for a in args]


def _tail(text: str, chars: int) -> str:
    return text if len(text) <= chars else "..." + text[-chars:]


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process below it. torch's launcher starts each worker in a session of its own,
    so killing the launcher's process group would leave the workers running (and holding the output pipes open)."""
    try:
        workers = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        workers = []
    proc.kill()
    for worker in workers:
        try:
            worker.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(workers, timeout=30)


def _run(cmd, env, timeout) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        stdout, stderr = proc.communicate()
        stderr += f"\n[tests/launcher.py] killed with every process it started after {timeout} s"
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def accelerate_launch(target, *args, config_file=None, module=False, num_processes=2, marker=None, timeout=540,
                      check=True, env=None, unset=(), tail=4000) -> subprocess.CompletedProcess:
    """Launch `target` with `args` on `num_processes` CPU processes and wait (at most `timeout` seconds).

    With `check` (the default) the launch must exit 0 and, when `marker` is given, print it on stdout; otherwise the
    test fails with the tails of stdout and stderr. `env` overrides variables of `launch_env()`, `unset` removes some
    of this process's (e.g. PYTHONUNBUFFERED). A launch whose port was taken in the meantime is retried once."""
    cmd = launch_command(target, *args, config_file=config_file, module=module, num_processes=num_processes)
    full_env = launch_env(unset, **(env or {}))
    if config_file is not None and _is_deepspeed(config_file):
        full_env.pop("ACCELERATE_USE_CPU")
    proc = _run(cmd, full_env, timeout)
    if proc.returncode != 0 and any(s in proc.stderr for s in _PORT_TAKEN):
        proc = _run(cmd, full_env, timeout)
    if check:
        ok = proc.returncode == 0 and (marker is None or marker in proc.stdout)
        missing = f", {marker!r} not printed" if marker and proc.returncode == 0 else ""
        assert ok, (f"{' '.join(cmd[1:])}\nexit status {proc.returncode}{missing}\n"
                    f"--- stdout (tail) ---\n{_tail(proc.stdout, tail)}\n"
                    f"--- stderr (tail) ---\n{_tail(proc.stderr, tail)}")
    return proc
