"""Why the training phase runs longer in the process that holds vLLM's colocate engine (CPU build): one training-like
forward + backward of SmolLM2-135M-Instruct in fresh processes that differ only in what vLLM did to them (a benchmark,
not a test; load-robust counters, not only wall clock).

    .venv-vllm/bin/python bench/colocate_counters.py [--modes plain,import,memenv,engine,ballast] [--rows 64]
        [--length 152] [--iterations 3] [--threads 2] [--out bench/results/colocate_counters.json]

Modes, each in its own process, in this order of what vLLM does to the trainer's process: `plain` (nothing), `import`
(`import vllm` and its CPU ops), `memenv` (`torch.ops._C.init_cpu_memory_env([0])` alone, the call vLLM's CPU worker
makes: libnuma's bind policy), `engine` (a colocate engine built as TRL builds it: `vllm.LLM`, external launcher,
`vllm_speed.ENGINE`'s memory share and model length), `ballast` (no vLLM: a tensor of `--ballast-gb`, the engine's
resident memory beyond the policy's, allocated and touched: what the engine's memory alone does).

The workload: the policy's loss over a (rows, length) batch as TRL computes it (the full model's forward, log-softmax
of the completion's logits gathered at the tokens, backward): at 64 x 152 the logits alone are 1.9 GB of float32, the
size at which `vllm_speed.md` measured the colocate process's training phase longer. Per iteration: wall seconds,
user / system CPU seconds, minor / major page faults, voluntary / involuntary context switches (`getrusage`), and the
process's threads, VmRSS / VmHWM, Cpus_allowed_list, `torch.get_num_threads()`, and its memory policy (the policies
`/proc/self/numa_maps` lists for the heap and anonymous mappings).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

MODES = ("plain", "import", "memenv", "engine", "ballast")
#: the engine's resident memory beyond a plain process's after the policy was loaded (VmRSS 3.70 GB against 0.45 GB in
#: the first run of this benchmark, colocate_counters.json)
BALLAST_GB = 3.25
#: /proc/vmstat's reclaim and huge-page counters, read around each iteration (memory pressure shows there)
VMSTAT = ("pgscan_kswapd", "pgscan_direct", "pgsteal_kswapd", "pgsteal_direct", "compact_stall", "thp_fault_alloc",
          "thp_fault_fallback")
RUSAGE = ("ru_utime", "ru_stime", "ru_minflt", "ru_majflt", "ru_nvcsw", "ru_nivcsw")


def status() -> dict:
    """The fields of /proc/self/status that bear on speed, the thread count of torch and the memory policies."""
    import torch

    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Threads", "VmRSS", "VmHWM", "Cpus_allowed_list", "Mems_allowed_list"):
                fields[key] = value.strip()
    policies = collections.Counter()
    try:
        with open("/proc/self/numa_maps") as f:
            for line in f:
                policies[line.split()[1]] += 1
    except OSError:
        pass
    return {**fields, "torch_threads": torch.get_num_threads(), "numa_policies": dict(policies),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "ld_preload": ":".join(os.path.basename(x) for x in os.environ.get("LD_PRELOAD", "").split(":") if x)}


def threads() -> dict:
    """Per thread of this process: name, voluntary context switches, CPU ticks (user + system)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                fields = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[tid] = (fields["Name"], int(fields["voluntary_ctxt_switches"]), int(stat[11]) + int(stat[12]))
    return out


def thread_activity(seconds: float) -> list:
    """The threads that woke up while this process's main thread slept `seconds`: (name, voluntary context switches,
    CPU ticks) each, the busiest first."""
    before = threads()
    time.sleep(seconds)
    after = threads()
    rows = [(after[t][0], after[t][1] - before[t][1], after[t][2] - before[t][2]) for t in after if t in before]
    return sorted((r for r in rows if r[1] or r[2]), key=lambda r: -r[1])


def build_engine(model_dir: str):
    """A colocate engine as TRL 1.16 builds one (one process, external launcher), sized as `vllm_speed` sizes it."""
    from vllm_speed import ENGINE, MAX_NUM_SEQS

    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT", "29611")})
    import vllm

    return vllm.LLM(model=model_dir, dtype="float32", gpu_memory_utilization=ENGINE["vllm_gpu_memory_utilization"],
                    max_model_len=ENGINE["vllm_max_model_length"], max_num_seqs=MAX_NUM_SEQS,
                    distributed_executor_backend="external_launcher", max_num_batched_tokens=4096,
                    logprobs_mode="processed_logprobs", seed=0)


def vmstat() -> dict:
    with open("/proc/vmstat") as f:
        pairs = (line.split() for line in f)
        return {k: int(v) for k, v in pairs if k in VMSTAT}


def prepare(mode: str, model_dir: str, ballast_gb: float = BALLAST_GB):
    """Do to this process what `mode` names; returns what must stay alive (the engine, the ballast)."""
    if mode == "plain":
        return None
    if mode == "ballast":
        import torch

        return torch.ones(int(ballast_gb * 1e9) // 4)  # written: every page resident
    import vllm
    import vllm._custom_ops  # noqa: F401 - loads torch.ops._C

    if mode == "import":
        return None
    if mode == "memenv":
        import torch

        torch.ops._C.init_cpu_memory_env([0])
        return None
    return build_engine(model_dir)


def measure(mode: str, model_dir: str, rows: int, length: int, prompt: int, iterations: int,
            workload: str = "model", threads: int | None = None, ballast_gb: float = BALLAST_GB) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    keep = prepare(mode, model_dir, ballast_gb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, model.config.vocab_size, (rows, length))
    before = status()
    runs = []
    for _ in range(iterations):
        start_usage, start, start_vm = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), vmstat()
        if workload == "logits":  # the loss's tensors alone, at their size: (rows, length - prompt, vocabulary)
            logits = torch.randn(rows, length - prompt, model.config.vocab_size, requires_grad=True)
        else:
            logits = model(input_ids=ids).logits[:, prompt - 1:-1].float()
        logps = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, prompt:, None]).squeeze(-1)
        (-logps.mean()).backward()
        if workload == "logits":
            usage = resource.getrusage(resource.RUSAGE_SELF)
            runs.append({"wall": time.perf_counter() - start, "load_average": os.getloadavg()[0],
                         **{k[3:]: getattr(usage, k) - getattr(start_usage, k) for k in RUSAGE}})
            del logits, logps
            continue
        optimizer.step()
        optimizer.zero_grad()
        del logits, logps
        wall, usage = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
        end_vm = vmstat()
        runs.append({"wall": wall, **{k[3:]: getattr(usage, k) - getattr(start_usage, k) for k in RUSAGE},
                     "load_average": os.getloadavg()[0], "vmstat": {k: end_vm[k] - start_vm[k] for k in end_vm}})
    idle = thread_activity(5.0)
    del keep
    return {"mode": mode, "workload": workload, "rows": rows, "length": length, "status_before": before,
            "status_after": status(), "iterations": runs, "idle_threads_5s": idle}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="plain,import,memenv,engine,ballast")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--length", type=int, default=152)
    parser.add_argument("--prompt", type=int, default=24, help="prompt tokens (the loss is over the rest)")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--workload", choices=["model", "logits"], default="model",
                        help="the model's forward and backward, or the loss's log-softmax over random logits alone")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one a core)")
    parser.add_argument("--ballast-gb", type=float, default=BALLAST_GB, help="the ballast mode's resident memory")
    parser.add_argument("--model-dir")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "colocate_counters.json"))
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    from trl_ppo_variants.smollm2 import smollm2_checkpoint
    from trl_ppo_variants.toy import use_offline_env

    use_offline_env()
    model_dir = opts.model_dir or smollm2_checkpoint()
    if opts.worker:
        print("RESULT " + json.dumps(measure(opts.worker, model_dir, opts.rows, opts.length, opts.prompt,
                                             opts.iterations, opts.workload, opts.threads,
                                             opts.ballast_gb)), flush=True)
        return 0
    results = []
    for mode in opts.modes.split(","):
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", mode, "--model-dir", model_dir,
                               "--rows", str(opts.rows), "--length", str(opts.length), "--prompt", str(opts.prompt),
                               "--iterations", str(opts.iterations),
                               "--workload", opts.workload, "--ballast-gb", str(opts.ballast_gb),
                               *(["--threads", str(opts.threads)] if opts.threads else [])],
                              capture_output=True, text=True, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            print(f"{mode}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
            continue
        results.append(json.loads(lines[-1][7:]))
        print(json.dumps(results[-1]), flush=True)
        with open(opts.out, "w") as f:
            json.dump(results, f, indent=1)
    loads = [i["load_average"] for r in results for i in r["iterations"]] or [0.0]
    text = summary_table(results)
    with open(os.path.splitext(opts.out)[0] + ".md", "w") as f:
        f.write(f"SmolLM2-135M-Instruct's forward + backward + AdamW step on a {opts.rows} x {opts.length} batch "
                f"({opts.workload}), each mode in a fresh process; medians over {opts.iterations - 1} iterations after "
                f"a warm-up one; 1-min load average {min(loads):.1f}-{max(loads):.1f}.\n\n{text}\n")
    print(text)
    return 0


def summary_table(results: list[dict]) -> str:
    """Per mode, the medians over its iterations after the first (the first: warm-up)."""
    import statistics

    lines = ["| mode | torch threads | wall (s) | user CPU (s) | system CPU (s) | minor faults | kswapd + direct scans |"
             " VmRSS before (GB) |", "|" + " --- |" * 8]
    for r in results:
        kept = r["iterations"][1:] or r["iterations"]

        def med(key, runs=kept):
            return statistics.median(i[key] for i in runs)

        scans = statistics.median(i.get("vmstat", {}).get("pgscan_kswapd", 0) + i.get("vmstat", {}).get(
            "pgscan_direct", 0) for i in kept)
        rss = int(r["status_before"]["VmRSS"].split()[0]) / 1e6
        lines.append(f"| {r['mode']} | {r['status_before']['torch_threads']} | {med('wall'):.1f} | {med('utime'):.1f} "
                     f"| {med('stime'):.1f} | {med('minflt'):.0f} | {scans:.0f} | {rss:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
