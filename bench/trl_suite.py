"""TRL's own GRPO tests against every trainer of this package: how much of a drop-in each one is.

    python bench/trl_suite.py --trl PATH_TO_TRL                    # every trainer, then the table
    python bench/trl_suite.py --trl PATH --trainers grpo,rloo -k "reward"   # a subset
    python bench/trl_suite.py --trl PATH --vlm                     # every trainer, the vision-language tests only

`PATH_TO_TRL` is a TRL checkout (a work tree) or a git directory (a bare clone or a mirror: `--rev` picks the commit,
default HEAD). Its `tests/` and `scripts/` are copied into a scratch folder (the checkout is never changed, nothing of
TRL's enters this repository) and `tests/test_grpo_trainer.py` runs once per trainer under pytest with
`bench/trl_suite_plugin.py`, which rebinds the module's `GRPOTrainer`/`GRPOConfig` to that trainer's pair, caps the
run length of the tests that leave `max_steps` unset (`--steps`, default 6; VAPO runs TRL's own lengths, which its
default value pre-training of 50 steps needs) and reads the `trl-internal-testing/*` data sets offline. The Hub's tiny
models are rebuilt offline by `bench/trl_suite_assets.py` (the same architectures, found through `HF_HUB_CACHE`).
`trl.GRPOTrainer` itself is the baseline ("grpo"); this package's `GRPOTrainer` is "our_grpo".
`--vlm` runs only TRL's vision-language tests (`TestGRPOTrainerVLM`: tiny Gemma3, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL and
Qwen3.5 models rebuilt by `trl_ppo_variants.toy_vlm`) and writes to `bench/results/trl_suite_vlm` unless `--out` says.

It prints, per trainer, passed / failed / skipped, then every test that fails with a trainer and passes with
trl.GRPOTrainer, with its one-line cause, and writes `<out>/trl_suite.md` and `<out>/trl_suite.json`.
Tests skipped for a missing optional package (vLLM, liger-kernel, bitsandbytes, jmespath for the tool and environment
tests) or a GPU are listed by reason: put the packages on `PYTHONPATH` to include them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(1, str(ROOT))

from trl_suite_plugin import TRAINERS  # noqa: E402

TEST_FILE = "tests/test_grpo_trainer.py"
#: trainers whose default config needs more steps than the cap: they run the tests' own lengths
OWN_LENGTH = {"vapo": "its value pre-training (value_pretrain_steps=50) needs more than the cap"}
DEFAULT_OUT = BENCH / "results" / "trl_suite"
VLM_OUT = BENCH / "results" / "trl_suite_vlm"
#: the pytest -k expression of `--vlm`: TRL's vision-language test class
VLM_TESTS = "TestGRPOTrainerVLM"
#: what is exported from TRL's repository
TRL_PARTS = ("tests", "scripts", "pyproject.toml")


def export_trl(trl: Path, rev: str, dest: Path) -> str:
    """Copy `tests/`, `scripts/` and `pyproject.toml` of the TRL checkout or git directory `trl` into `dest`; return a
    description of what was exported: TRL's commit only (results never name a folder of the machine that ran them)."""
    dest.mkdir(parents=True, exist_ok=True)
    if (trl / TEST_FILE).is_file():
        for part in ("tests", "scripts"):
            if (trl / part).is_dir():
                shutil.copytree(trl / part, dest / part, dirs_exist_ok=True)
        if (trl / "pyproject.toml").is_file():
            shutil.copy(trl / "pyproject.toml", dest / "pyproject.toml")
        commit = subprocess.run(["git", "-C", str(trl), "rev-parse", "HEAD"], capture_output=True, text=True)
        if commit.returncode != 0:
            return "TRL's repository (a work tree of unknown commit)"
        dirty = subprocess.run(["git", "-C", str(trl), "status", "--porcelain", "--", *TRL_PARTS],
                               capture_output=True, text=True).stdout.strip()
        return f"TRL's repository at {commit.stdout.strip()[:12]}" + (" with local changes" if dirty else "")
    git = ["git", "--git-dir", str(trl)]
    commit = subprocess.run([*git, "rev-parse", rev], capture_output=True, text=True)
    if commit.returncode != 0:
        raise SystemExit(f"--trl: {trl} is neither a TRL work tree (no {TEST_FILE}) nor a git directory with {rev!r}")
    archive = subprocess.run([*git, "archive", rev, *TRL_PARTS], capture_output=True,
                             check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return f"TRL's repository at {commit.stdout.strip()[:12]}"


def trl_version_note() -> str:
    import trl

    return f"installed trl {trl.__version__}"


def run_trainer(key: str, workdir: Path, assets: Path, out: Path, steps: int, extra: list[str], timeout: int) -> dict:
    """One pytest run of the test file with `key`'s trainer; returns the plugin's report (plus the log's tail)."""
    runs = out / "runs"  # per trainer: the plugin's report and the pytest log (not kept in git)
    runs.mkdir(parents=True, exist_ok=True)
    report = runs / f"{key}.json"
    env = dict(os.environ)
    pythonpath = [str(ROOT), str(BENCH)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update({
        "PYTHONPATH": os.pathsep.join(pythonpath),
        "HF_HUB_CACHE": str(assets / "hub"),
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "WANDB_DISABLED": "true", "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        "TRL_SUITE_TRAINER": key, "TRL_SUITE_ASSETS": str(assets), "TRL_SUITE_REPORT": str(report),
        "TRL_SUITE_MAX_STEPS": "" if key in OWN_LENGTH else str(steps),
    })
    cmd = [sys.executable, "-m", "pytest", TEST_FILE, "-p", "trl_suite_plugin", "-p", "no:cacheprovider", "-q",
           "-o", f"timeout={timeout}", *extra]
    log = runs / f"{key}.log"
    start = time.monotonic()
    with open(log, "w") as handle:
        proc = subprocess.run(cmd, cwd=workdir, env=env, stdout=handle, stderr=subprocess.STDOUT)
    wall_s = round(time.monotonic() - start)
    if not report.exists():
        tail = log.read_text(errors="replace").splitlines()[-5:]
        return {"trainer": key, "tests": {}, "error": f"pytest exited {proc.returncode}: " + " | ".join(tail),
                "wall_s": wall_s}
    result = json.loads(report.read_text())
    result["wall_s"] = wall_s
    report.write_text(json.dumps(result, indent=1))
    return result


def bucket(outcome: str) -> str:
    if outcome in ("passed", "xpassed"):
        return "passed"
    if outcome in ("skipped", "xfailed"):
        return "skipped"
    return "failed"


def short(nodeid: str) -> str:
    return nodeid.split("::", 1)[-1]


def summarize(results: dict[str, dict], baseline: str = "grpo") -> tuple[str, dict]:
    """The markdown table and, per trainer, the tests that fail with it and pass with the baseline."""
    lines = ["| trainer | passed | failed | skipped | fails where trl.GRPOTrainer passes |", "|---|---|---|---|---|"]
    base = {k: bucket(v["outcome"]) for k, v in results.get(baseline, {}).get("tests", {}).items()}
    regressions = {}
    for key, result in results.items():
        tests = result.get("tests", {})
        counts = Counter(bucket(v["outcome"]) for v in tests.values())
        worse = {k: v.get("cause", "") for k, v in tests.items()
                 if bucket(v["outcome"]) == "failed" and base.get(k) == "passed"}
        regressions[key] = worse
        label = "trl.GRPOTrainer" if key == baseline else key
        note = "" if key != baseline else "(baseline)"
        if result.get("error"):
            note = result["error"][:200]
        lines.append(f"| {label} | {counts['passed']} | {counts['failed']} | {counts['skipped']} | "
                     f"{len(worse) if key != baseline else note} |")
    text = "\n".join(lines)
    for key, worse in regressions.items():
        if key == baseline or not worse:
            continue
        text += f"\n\n{key}: {len(worse)} failing where trl.GRPOTrainer passes\n"
        text += "\n".join(f"- `{short(k)}`: {cause}" for k, cause in sorted(worse.items()))
    base_failed = {k: v.get("cause", "") for k, v in results.get(baseline, {}).get("tests", {}).items()
                   if bucket(v["outcome"]) == "failed"}
    if base_failed:
        text += (f"\n\ntrl.GRPOTrainer itself fails {len(base_failed)} (tests of another TRL version than the installed "
                 "one, or that hard-code the real Hub tokenizers' ids):\n")
        text += "\n".join(f"- `{short(k)}`: {cause}" for k, cause in sorted(base_failed.items()))
    skips = Counter(v.get("cause", "") for v in results.get(baseline, {}).get("tests", {}).values()
                    if bucket(v["outcome"]) == "skipped")
    if skips:
        text += "\n\nSkipped (trl.GRPOTrainer's run): " + "; ".join(f"{n} x {why}" for why, n in skips.most_common())
    return text, regressions


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--trl", type=Path, default=os.environ.get("TRL_CHECKOUT"),
                        help="TRL checkout or git directory (default: $TRL_CHECKOUT)")
    parser.add_argument("--rev", default="HEAD", help="commit to export from a git directory (default HEAD)")
    parser.add_argument("--trainers", default=",".join(TRAINERS),
                        help=f"comma-separated, from {', '.join(TRAINERS)} (grpo, the baseline, is always run)")
    parser.add_argument("--steps", type=int, default=6, help="max_steps of the tests that leave it unset (default 6)")
    parser.add_argument("--jobs", type=int, default=1, help="trainers run at the same time (default 1)")
    parser.add_argument("--timeout", type=int, default=600, help="per-test timeout in seconds (default 600)")
    parser.add_argument("--assets", type=Path, default=None,
                        help="where the offline models and data sets are built and reused (default: "
                             "trl_suite_assets under the package's cache, ~/.cache/trl_ppo_variants)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results folder (default {DEFAULT_OUT}; with --vlm {VLM_OUT})")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression (a subset of the tests)")
    parser.add_argument("--vlm", action="store_true",
                        help=f"only the vision-language tests (-k {VLM_TESTS}; with -k: both must match)")
    parser.add_argument("--reuse", action="store_true", help="reuse <out>/runs/<trainer>.json of an earlier run")
    args = parser.parse_args(argv)
    if args.trl is None:
        parser.error("--trl PATH (a TRL checkout or git directory) is required, or set TRL_CHECKOUT")
    keys = [k.strip() for k in args.trainers.split(",") if k.strip()]
    unknown = [k for k in keys if k not in TRAINERS]
    if unknown:
        parser.error(f"--trainers: unknown {unknown}; expected some of {list(TRAINERS)}")
    keys = ["grpo"] + [k for k in keys if k != "grpo"]
    if args.vlm:
        args.keyword = VLM_TESTS if not args.keyword else f"{VLM_TESTS} and ({args.keyword})"
    if args.out is None:
        args.out = VLM_OUT if args.vlm else DEFAULT_OUT
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="trl_suite_"))
    source = export_trl(args.trl.resolve(), args.rev, workdir)
    if args.assets is None:
        from trl_ppo_variants.smollm2 import smollm2_cache_root

        args.assets = Path(smollm2_cache_root()) / "trl_suite_assets"
    assets = args.assets.resolve()
    from trl_suite_assets import build_assets

    build_assets(assets, workdir)
    extra = ["-k", args.keyword] if args.keyword else []
    print(f"trl_suite: {TEST_FILE} of {source}; {trl_version_note()}; {len(keys)} trainer(s), {args.jobs} at a time",
          flush=True)

    results: dict[str, dict] = {}

    def one(key):
        cached = out / "runs" / f"{key}.json"
        if args.reuse and cached.exists():
            return key, json.loads(cached.read_text())
        return key, run_trainer(key, workdir, assets, out, args.steps, extra, args.timeout)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for key, result in pool.map(one, keys):
            results[key] = result
            counts = Counter(bucket(v["outcome"]) for v in result.get("tests", {}).values())
            print(f"trl_suite: {key}: {counts['passed']} passed, {counts['failed']} failed, "
                  f"{counts['skipped']} skipped, {result.get('wall_s', '?')} s"
                  f"{' (' + result['error'] + ')' if result.get('error') else ''}",
                  flush=True)
    shutil.rmtree(workdir, ignore_errors=True)

    text, _ = summarize(results)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lengths = f"max_steps {args.steps} where a test leaves it unset" + "".join(
        f"; {k}: the tests' own lengths ({why})" for k, why in OWN_LENGTH.items() if k in keys)
    selection = f"; the tests of -k {args.keyword!r}" if args.keyword else ""
    header = f"{TEST_FILE} of {source}, {trl_version_note()}, {stamp}; {lengths}{selection}."
    from trl_suite_assets import VLM_NOT_BUILT

    text += "\n\nVision-language models not rebuilt (their tests are skipped): " + "; ".join(
        f"{name} ({why})" for name, why in VLM_NOT_BUILT.items())
    walls = [f"{k} {round(r['wall_s'] / 60)}" for k, r in results.items() if r.get("wall_s") is not None]
    if walls:
        text += f"\n\nWall time per trainer (minutes, {args.jobs} at a time): " + ", ".join(walls)
    print("\n" + header + "\n\n" + text)
    (out / "trl_suite.md").write_text(header + "\n\n" + text + "\n")
    (out / "trl_suite.json").write_text(json.dumps({"source": source, "date": stamp, "steps": args.steps,
                                                    "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
