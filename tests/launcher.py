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

`machines=2` runs the multi-node recipe as docs/how-to/distributed.md tells users to, on this one host: two `accelerate
launch` commands, `--num_machines 2 --machine_rank 0|1 --main_process_ip 127.0.0.1 --main_process_port P`, one process
each. Two launchers must agree on a port, so the test picks a free one (retried with another when it was taken in the
meantime). A DeepSpeed config becomes the shipped multi-node recipe (recipes/accelerate/multi_node_zero3.yaml) sized
down to 2 machines x 1 process, with the test config's own DeepSpeed settings (ZeRO stage, clipping). When one launcher
fails, the other is killed after a short grace, as a cluster's scheduler ends a job whose node failed (torch's launcher
on one node does not watch the other). Both results come back as one: the first failure's exit status, machine 0's
stdout then machine 1's, their stderr with the failed machine's last. A test opts in by taking the `machines` parameter
(tests/conftest.py) and passing it on; a test that starts a vLLM server first does the same, the server being a third
process that both machines reach on the loopback.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
ACCELERATE = Path(sys.executable).with_name("accelerate")
MULTI_NODE_RECIPE = ROOT / "recipes" / "accelerate" / "multi_node_zero3.yaml"
LOOPBACK = "127.0.0.1"
# how long the other machine's launcher may run on once one has failed (a healthy peer then waits in a collective)
PEER_GRACE_S = 5

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


def _load(config_file) -> dict:
    with open(config_file) as f:
        return yaml.safe_load(f) or {}


def _is_deepspeed(config_file) -> bool:
    return _load(config_file).get("distributed_type") == "DEEPSPEED"


def multi_node_config(config_file, folder) -> Path:
    """The shipped multi-node recipe sized down to 2 machines x 1 CPU process, with the DeepSpeed settings of
    `config_file` (a test's own ZeRO config), written to `folder`. Its DeepSpeed keys other than those (the standard
    multi-node launcher, no offload) are the recipe's: that is what runs."""
    config = _load(MULTI_NODE_RECIPE)
    config["deepspeed_config"] = {**config["deepspeed_config"], **_load(config_file).get("deepspeed_config", {})}
    config.update(num_machines=2, num_processes=2, mixed_precision="no", main_process_ip=LOOPBACK)
    path = Path(folder) / "multi_node.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def launch_command(target, *args, config_file=None, module=False, num_processes=2, machines=1, machine_rank=0,
                   port=0) -> list[str]:
    """`accelerate launch` of `target` (a script of tests/scripts/, or a module with `module=True`) on a free port.
    Without `config_file`: DDP over gloo (`--multi_gpu`; `--cpu` would start one process). With `machines=2`: the
    command of machine `machine_rank` of two on this host, `num_processes` over both, machine 0 listening on `port`."""
    cmd = [str(ACCELERATE), "launch"]
    if config_file is not None:
        cmd += ["--config_file", str(config_file)]
    if config_file is None or not _is_deepspeed(config_file):
        cmd.append("--multi_gpu")
    cmd += ["--num_processes", str(num_processes), "--num_machines", str(machines), "--mixed_precision", "no"]
    if machines > 1:
        cmd += ["--machine_rank", str(machine_rank), "--main_process_ip", LOOPBACK]
    cmd += ["--main_process_port", str(port)]
    cmd += ["-m", target] if module else [str(SCRIPTS / target)]
    return cmd + [str(a) for a in args]


def free_port() -> int:
    """A port free now on the loopback (two launchers cannot share `--main_process_port 0`: each would pick its own)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


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


def _run_machines(cmds, env, timeout) -> subprocess.CompletedProcess:
    """Run the launchers of several machines at once (output to files: two pipes each could fill while we wait on
    another). Killed all with their workers at `timeout`; the others `PEER_GRACE_S` after one fails."""
    with tempfile.TemporaryDirectory(prefix="machines") as folder:
        outs = [(open(Path(folder) / f"out{m}", "w+"), open(Path(folder) / f"err{m}", "w+")) for m in range(len(cmds))]
        procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, text=True)
                 for cmd, (out, err) in zip(cmds, outs)]
        notes = [""] * len(procs)
        start, failed_at, first_failure = time.monotonic(), None, None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            for m, p in enumerate(procs):
                if p.poll() not in (None, 0) and first_failure is None:
                    first_failure, failed_at = m, now
            over = now - start > timeout
            if over or (failed_at is not None and now - failed_at > PEER_GRACE_S):
                for m, p in enumerate(procs):
                    if p.poll() is None:
                        _kill_tree(p)
                        p.wait()
                        notes[m] = (f"\n[tests/launcher.py] machine {m} killed with every process it started "
                                    + (f"after {timeout} s" if over else f"{PEER_GRACE_S} s after machine "
                                       f"{first_failure} failed"))
                break
            time.sleep(0.2)
        codes = [p.returncode for p in procs]
        if first_failure is None:
            first_failure = next((m for m, c in enumerate(codes) if c != 0), 0)
        texts = []
        for out, err in outs:
            out.seek(0), err.seek(0)
            texts.append((out.read(), err.read()))
            out.close(), err.close()
    stdout = "".join(t[0] for t in texts)
    # the failed machine's last, where a failure's tail shows it
    order = sorted(range(len(texts)), key=lambda m: m == first_failure and codes[m] != 0)
    stderr = "".join(f"--- machine {m} ---\n{texts[m][1]}{notes[m]}\n" for m in order)
    return subprocess.CompletedProcess(cmds[0], codes[first_failure], stdout, stderr)


def accelerate_launch(target, *args, config_file=None, module=False, num_processes=2, machines=1, marker=None,
                      timeout=540, check=True, env=None, unset=(), tail=4000) -> subprocess.CompletedProcess:
    """Launch `target` with `args` on `num_processes` CPU processes and wait (at most `timeout` seconds); with
    `machines=2`, as two machines of `num_processes // 2` processes each (two launchers on this host).

    With `check` (the default) the launch must exit 0 and, when `marker` is given, print it on stdout; otherwise the
    test fails with the tails of stdout and stderr. `env` overrides variables of `launch_env()`, `unset` removes some
    of this process's (e.g. PYTHONUNBUFFERED). A launch whose port was taken in the meantime is retried once."""
    full_env = launch_env(unset, **(env or {}))
    deepspeed = config_file is not None and _is_deepspeed(config_file)
    if deepspeed:
        full_env.pop("ACCELERATE_USE_CPU")
    with tempfile.TemporaryDirectory(prefix="launch") as folder:
        if machines > 1 and deepspeed:
            config_file = multi_node_config(config_file, folder)

        def once():
            if machines == 1:
                cmd = launch_command(target, *args, config_file=config_file, module=module,
                                     num_processes=num_processes)
                return _run(cmd, full_env, timeout)
            port = free_port()
            cmds = [launch_command(target, *args, config_file=config_file, module=module,
                                   num_processes=num_processes, machines=machines, machine_rank=m, port=port)
                    for m in range(machines)]
            return _run_machines(cmds, full_env, timeout)

        proc = once()
        if proc.returncode != 0 and any(s in proc.stderr for s in _PORT_TAKEN):
            proc = once()
    if check:
        ok = proc.returncode == 0 and (marker is None or marker in proc.stdout)
        missing = f", {marker!r} not printed" if marker and proc.returncode == 0 else ""
        assert ok, (f"{' '.join(proc.args[1:])}\nexit status {proc.returncode}{missing}\n"
                    f"--- stdout (tail) ---\n{_tail(proc.stdout, tail)}\n"
                    f"--- stderr (tail) ---\n{_tail(proc.stderr, tail)}")
    return proc
