"""The trainers against a real vLLM server process on CPU (`trl-ppo-variants vllm-serve`, `trl_ppo_variants/
vllm_server.py`), in vLLM's CPU build (`make test-vllm` runs it in `.venv-vllm`).

One server for the module, started as a user starts it (`python -m trl_ppo_variants vllm-serve --model DIR --port
N`) on a free loopback port, serving the tied-head toy model (head_dim 32) eagerly. Against it:
`tests/scripts/vllm_server.py` runs every trainer's case in one subprocess (2 steps each, server mode, the sync through
the shared-memory transport, the server then measured against the policy's forward on fixed completions), the same
script under `accelerate launch` with two processes (DDP and ZeRO-3: only the main process talks to the server), and
the failures at start run in this process (no server at the URL; a server serving another model). The server is
killed with its whole process group at the end.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launcher import accelerate_launch, free_port
from test_vllm import _case, _logged, assert_selection_rounds

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
sys.path.insert(0, str(SCRIPTS))
import vllm_colocate as vllm_colocate_cases  # noqa: E402
#: server vs policy, max per-token |log-prob difference| of fixed completions: the colocate engine's bound
#: (`test_vllm.ENGINE_BOUND`; the server's sync is the colocate CPU engine's, through a file)
SERVER_BOUND = 1e-4
#: how long the server may take to answer /health (about 55-80 s on a busy 2-core machine)
START_TIMEOUT = 420
#: the trainers, 2 steps each (the names of `vllm_colocate.CASES`)
CASES = ["grpo", "grpo_lora", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline", "dapo", "grpo_speed",
         "grpo_greso", "ttrl", "ppo", "vapo", "process_grpo"]
#: the two-process launches, (accelerate config, cases): DDP (no config) with the trainers whose generation calls
#: differ from GRPO's (ReMax's greedy rows, DAPO's and SPEED's rounds, TTRL's votes), and DeepSpeed ZeRO-3
ZERO3 = ROOT / "tests" / "configs" / "critic_zero3.yaml"
#: launch: (accelerate config, cases, machines); "zero3_2machines" is the multi-node recipe (multi_node_zero3.yaml,
#: sized down by tests/launcher.py) as two `accelerate launch` commands on this host, both talking to the one server
LAUNCHES = {"ddp": (None, ["grpo", "rloo", "remax", "dapo", "grpo_speed", "ttrl", "ppo"], 1),
            "zero3": (ZERO3, ["grpo", "ppo"], 1),
            "zero3_2machines": (ZERO3, ["grpo", "remax"], 2)}
LAUNCH_CASES = [(launch, case) for launch, (_, cases, _) in LAUNCHES.items() for case in cases]
#: the cases of one generation call a step (8 rows a rank)
ONE_CALL = {"grpo", "rloo", "ttrl", "ppo"}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM's CPU build is not installed here (`make test-vllm` runs these tests)"),
]


def subprocess_env(**extra) -> dict:
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)), **extra}


class Server:
    """`trl-ppo-variants vllm-serve` of `model_dir` on a free loopback port, in a session of its own."""

    def __init__(self, model_dir: str, log_path: str, env: dict | None = None):
        self.model_dir, self.port = model_dir, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trl_ppo_variants", "vllm-serve", "--model", model_dir, "--host", "127.0.0.1",
             "--port", str(self.port), "--max_model_len", "64", "--enforce_eager", "true"],
            stdout=self.log, stderr=subprocess.STDOUT, env={**subprocess_env(), **(env or {})}, start_new_session=True)
        self.started = time.monotonic()

    def wait(self, timeout: float = START_TIMEOUT) -> float:
        """Seconds until /health answered 200; fails with the log's tail if the server exits or takes too long."""
        import requests

        while time.monotonic() - self.started < timeout:
            if self.proc.poll() is not None:
                break
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - self.started
            except requests.RequestException:
                pass
            time.sleep(1)
        self.stop()
        pytest.fail(f"the server did not answer {self.url}/health: {self.tail()}")

    def tail(self, chars: int = 4000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-chars:]

    def stop(self):
        """Kill the server with every process it started (vLLM's engine process too)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


# ------------------------------------------------------------------------------------------------- no server
def test_a_sync_file_reads_back_every_tensor_bit_for_bit(tmp_path):
    """The transport's file: each tensor (any dtype, any shape, a scalar too) at an aligned offset, read back equal;
    a tensor that is not the one announced is refused before the server sees anything."""
    import torch

    from trl_ppo_variants.vllm_server import ALIGNMENT, read_tensors, write_tensors

    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(5),
               "d": torch.tensor(2.5, dtype=torch.float16), "e": torch.randn(4, 3).t()}  # e: not contiguous
    metadata = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in tensors.items()]
    info = write_tensors(str(tmp_path / "sync.bin"), metadata, iter(tensors.items()))
    assert info["names"] == list(tensors) and all(o % ALIGNMENT == 0 for o in info["offsets"]), info
    back = read_tensors(info["path"], info["dtype_names"], info["shapes"], info["offsets"])
    for (name, tensor), got in zip(tensors.items(), back):
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
    with pytest.raises(RuntimeError, match="weight sync: got b"):
        write_tensors(str(tmp_path / "bad.bin"), metadata[:1] + metadata[:1], iter(tensors.items()))


def test_the_server_command_on_cpu(tmp_path):
    """`vllm-serve`'s vLLM arguments on CPU: TRL's (processed log-probs, no log-prob cap), the CPU transport, the
    checkpoint's dtype for `auto`, and this package's worker extension (which registers the transport)."""
    from trl.scripts.vllm_serve import ScriptArguments

    from trl_ppo_variants.toy import make_toy_checkpoint
    from trl_ppo_variants.vllm_server import BACKEND, server_argv

    model = make_toy_checkpoint(str(tmp_path / "toy"), warm_steps=0)
    argv = server_argv(ScriptArguments(model=model, port=8123), ["--seed", "3"], on_cpu=True)

    def value(flag):
        return argv[argv.index(flag) + 1]

    assert value("--model") == model and value("--port") == "8123" and value("--dtype") == "float32"
    assert json.loads(value("--weight-transfer-config")) == {"backend": BACKEND}
    assert value("--logprobs-mode") == "processed_logprobs" and value("--max-logprobs") == "-1"
    assert value("--worker-extension-cls") == "trl_ppo_variants.vllm_server.WorkerExtension"
    assert argv[-2:] == ["--worker-extension-cls", "trl_ppo_variants.vllm_server.WorkerExtension"]
    assert value("--seed") == "3"
    gpu = server_argv(ScriptArguments(model=model, dtype="bfloat16"), None, on_cpu=False)
    assert json.loads(gpu[gpu.index("--weight-transfer-config") + 1]) == {"backend": "nccl"}
    assert gpu[gpu.index("--dtype") + 1] == "bfloat16" and "--worker-extension-cls" not in gpu


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory):
    from vllm_colocate import build_model

    return build_model("tied")


@pytest.fixture(scope="module")
def server(toy_model, tmp_path_factory):
    """The module's server, serving `toy_model`; killed at the module's end."""
    server = Server(toy_model, str(tmp_path_factory.mktemp("server") / "server.log"))
    server.start_seconds = server.wait()
    print(f"\nvllm-serve answered /health after {server.start_seconds:.0f} s", flush=True)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cases_run(server, toy_model, tmp_path_factory):
    """{case: result} of every trainer's case against the server, in one subprocess."""
    out = tmp_path_factory.mktemp("cases") / "result.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "vllm_server.py"), str(out), server.url, toy_model, *CASES],
                          env=subprocess_env(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0 and out.exists(), (proc.stdout[-3000:], proc.stderr[-5000:])
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES)
def test_every_trainer_trains_against_the_server_and_stays_in_sync(case, cases_run):
    """Each trainer trains 2 steps generating with the server; its sync went through the CPU transport once a step;
    after training and a sync the server scores fixed completions as the policy's forward does, and it is far from
    the untrained policy (the sync carried the training's change: not vacuous)."""
    result = _case(cases_run, case)
    assert result["generation"] == "ServerVLLMGeneration" and result["transport"], result
    assert result["steps"] == 2 and result["syncs_in_training"] == [0, 1], result
    assert result["untrained"] <= SERVER_BOUND and result["trained"] <= SERVER_BOUND, result
    assert result["policy_moved"] > 1e-3, result
    assert result["server_vs_initial_policy"] > 100 * SERVER_BOUND, result
    differences = _logged(result, "sampling/sampling_logp_difference/max")  # TRL's own measure, sampled tokens
    assert len(differences) == 2 and max(differences) <= SERVER_BOUND, result["logs"]


def test_the_max_log_prob_difference_over_every_trainer(cases_run):
    """The largest server-vs-policy difference of all cases, printed for the record (each is bounded above)."""
    worst = max(max(_case(cases_run, c)["untrained"], _case(cases_run, c)["trained"]) for c in CASES)
    print(f"\nserver vs policy, max over {len(CASES)} trainers: {worst:.3g} nats/token", flush=True)
    assert worst <= SERVER_BOUND


def test_remax_greedy_rows_are_the_servers_greedy_decoding(cases_run):
    """ReMax's baseline rows: one temperature-0 request to the server after the sampled rows (one row a group), equal
    to the server's own temperature-0 answer, and the policy's argmax at every position."""
    result = _case(cases_run, "remax")
    assert result["generate_calls"] == [[0, 8], [0, 2], [1, 8], [1, 2]], result["generate_calls"]
    assert len(result["greedy"]) == 2, result["greedy"]
    for record in result["greedy"]:
        assert record["rows"] == 2 and record["equal_to_temperature_0"], record
        assert record["argmax_gap"] <= SERVER_BOUND, record


@pytest.mark.parametrize("case, prefix, block", [("dapo", "dapo", 4), ("grpo_speed", "selection", 2),
                                                 ("grpo_greso", "selection", 4)])
def test_prompt_selection_rounds_are_one_server_request_each(case, prefix, block, cases_run):
    """DAPO's refill rounds, SPEED's screening and GRESO's rounds against the server: half the prompts have no
    reward spread, so steps take several rounds, each one generation call whose first holds the step's whole first
    round, `block` completions a prompt (`test_vllm.assert_selection_rounds`)."""
    assert_selection_rounds(_case(cases_run, case), prefix, block)


@pytest.mark.parametrize("case", ["ppo", "vapo"])
def test_the_critic_trains_and_stays_out_of_the_server(case, cases_run):
    """PPO's and VAPO's critics trained, and the sync sent the policy only (the server matches it, above)."""
    assert _case(cases_run, case)["critic_moved"] > 1e-3


@pytest.fixture(scope="module")
def launches(server, toy_model, tmp_path_factory):
    """{launch: {case: [rank 0's result, rank 1's]}} of the two-process launches against the one server."""
    results = {}
    for name, (config, cases, machines) in LAUNCHES.items():
        out = tmp_path_factory.mktemp(name)
        accelerate_launch("vllm_server.py", f"{out}/", server.url, toy_model, *cases, config_file=config,
                          machines=machines, timeout=900)
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        results[name] = {case: [rank[case] for rank in ranks] for case in cases}
    return results


@pytest.mark.parametrize("launch, case", LAUNCH_CASES)
def test_two_training_processes_share_one_server(launch, case, launches):
    """`accelerate launch --num_processes 2` (DDP; ZeRO-3, its parameters sharded; ZeRO-3 as two machines, one
    launcher each): only the main process holds a client and syncs, once a step; both ranks made the same generation
    calls (each its own rows: 8 a call, ReMax's 2 greedy rows, DAPO's and SPEED's rounds alike) and trained alike,
    and the server matches the main process's policy after training and a sync (under ZeRO-3 the gathered full
    parameters)."""
    main, other = launches[launch][case]
    for rank, result in enumerate((main, other)):
        assert "error" not in result, result.get("traceback", result.get("error"))
        assert result["world"] == 2 and result["steps"] == 2 and result["policy_moved"] > 1e-3, (rank, result)
        assert result["deepspeed_stage"] == (3 if launch.startswith("zero3") else None), result
        # two machines: each process is its machine's first (two launchers); one machine: local ranks 0 and 1
        assert result["local_rank"] == (0 if LAUNCHES[launch][2] == 2 else rank), (rank, result["local_rank"])
        if case in ONE_CALL:
            assert result["generate_calls"] == [[0, 8], [1, 8]], (rank, result["generate_calls"])
        if case == "remax":
            assert result["generate_calls"] == [[0, 8], [0, 2], [1, 8], [1, 2]], (rank, result["generate_calls"])
            assert all(r["equal_to_temperature_0"] for r in result["greedy"]) and len(main["greedy"]) == 2, result
    assert main["generate_calls"] == other["generate_calls"], (main["generate_calls"], other["generate_calls"])
    assert main["has_client"] and main["transport"] and main["syncs_in_training"] == [0, 1], main
    assert not other["has_client"] and other["syncs_in_training"] == [], other
    assert main["untrained"] <= SERVER_BOUND and main["trained"] <= SERVER_BOUND, main
    assert main["server_vs_initial_policy"] > 100 * SERVER_BOUND, main
    assert main["policy_moved"] == other["policy_moved"]


# ------------------------------------------------------------------------------------------------- a VLM
#: every trainer on the tiny Idefics3, the colocate tests' cases
VLM_CASES = list(vllm_colocate_cases.VLM_CASES)


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory):
    """{case: result} of every trainer on the tiny Idefics3 against a server of its own (stopped after the run)."""
    from vllm_colocate import build_model

    model_dir = build_model("vlm")
    directory = tmp_path_factory.mktemp("vlm")
    # the tiny VLM's image processor loads without torchvision once `toy_vlm` registered it (transformers < 5.18 asks
    # for torchvision, which .venv-vllm lacks): imported in each of the server's processes, through `sitecustomize`
    site = directory / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import trl_ppo_variants.toy_vlm  # noqa: F401\n")
    path = os.pathsep.join([str(ROOT), str(site), os.environ.get("PYTHONPATH", "")])
    server = Server(model_dir, str(directory / "server.log"), env={"PYTHONPATH": path})
    try:
        server.wait()
        out = directory / "result.json"
        proc = subprocess.run([sys.executable, str(SCRIPTS / "vllm_server.py"), str(out), server.url, model_dir,
                               "--vlm", *VLM_CASES], env=subprocess_env(), capture_output=True, text=True,
                              timeout=1200)
    finally:
        server.stop()
    assert proc.returncode == 0 and out.exists(), (proc.stdout[-3000:], proc.stderr[-5000:])
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", VLM_CASES)
def test_every_trainer_trains_a_vlm_against_the_server(case, vlm_run):
    """Each trainer trains the tiny Idefics3 2 steps against the server, every generation call mixing prompts with an
    image and without; after training and a sync the server scores fixed completions (two images, and none) as the
    policy's forward does: the images' features reach the server, and are the synced vision tower's (the trainer
    resets the server's encoder cache after a sync; the first image was seen before it)."""
    result = _case(vlm_run, case)
    assert result["generation"] == "ServerVLLMGeneration" and result["steps"] == 2, result
    assert result["untrained"] <= SERVER_BOUND and result["trained"] <= SERVER_BOUND, result
    assert result["policy_moved"] > 1e-3 and result["server_vs_initial_policy"] > 100 * SERVER_BOUND, result
    images = result["image_rows"]
    assert images and all(with_images > 0 and without > 0 for with_images, without in images), images
    effect = result["image_effect"]  # one completion after the same question about two images
    assert effect["server"] > 1e-2 and abs(effect["server"] - effect["policy"]) <= 2 * SERVER_BOUND, effect


# ------------------------------------------------------------------------------------------------- failures at start
def server_trainer(model_dir: str, url: str, output_dir: str, timeout: float = 30):
    """A GRPO trainer of `model_dir` in server mode at `url` (built here: no vLLM engine in this process)."""
    from vllm_colocate import varied_reward

    from trl_ppo_variants.toy import addition_dataset
    from trl_ppo_variants.trainers.grpo import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=output_dir, max_completion_length=6, max_steps=1, per_device_train_batch_size=4,
                      num_generations=2, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                      use_vllm=True, vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=timeout)
    return GRPOTrainer(model_dir, reward_funcs=varied_reward, args=args, train_dataset=addition_dataset(8))


def test_no_server_at_the_url_is_one_line_naming_it_within_the_timeout(toy_model, tmp_path):
    """Nothing listens at the URL: a one-line error naming the URL and the setting, after `vllm_server_timeout` (the
    client's wait alone, timed apart from the trainer's construction, which takes 5-40 s on a busy machine)."""
    from trl_ppo_variants import vllm_server

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError) as err:
        server_trainer(toy_model, url, str(tmp_path), timeout=3)
    message = str(err.value)
    assert message.startswith(f"vllm_server_base_url: The vLLM server can't be reached at {url} after 3 seconds")
    assert "\n" not in message, message
    start = time.monotonic()
    with pytest.raises(Exception, match="can't be reached"):
        vllm_server._client_class()(base_url=url, connection_timeout=3)
    assert time.monotonic() - start < 3 + 3, time.monotonic() - start  # the timeout and one retry interval


def test_a_server_serving_another_model_is_refused_at_start(server, tmp_path):
    """The policy has the served model's tokenizer and vocabulary but another width: refused at start, one line
    naming the URL and the field that differs (not only the model's name: the name could be anything)."""
    from trl_ppo_variants.toy import make_toy_checkpoint

    other = make_toy_checkpoint(str(tmp_path / "other"), warm_steps=0, hidden_size=64, tie_word_embeddings=True)
    with pytest.raises(ValueError) as err:
        server_trainer(other, server.url, str(tmp_path / "out"))
    message = str(err.value)
    assert message.startswith("vllm_server_base_url: ") and server.url in message and "\n" not in message, message
    assert "hidden_size is 128, the policy's 64" in message, message


# ------------------------------------------------------------------------------------------------- the server dies
def resumable_trainer(model_dir: str, url: str, output_dir: str, callbacks=(), save: bool = False):
    """A GRPO trainer of 4 steps in server mode, its sampling seeded on the server (the same completions from the same
    weights, run after run; at temperature 2, where the toy model's groups differ), saving every 2 steps with
    `save`."""
    from vllm_colocate import varied_reward

    from trl_ppo_variants.toy import addition_dataset
    from trl_ppo_variants.trainers.grpo import GRPOConfig, GRPOTrainer

    saving = {"save_strategy": "steps", "save_steps": 2} if save else {"save_strategy": "no"}
    args = GRPOConfig(output_dir=output_dir, max_completion_length=6, max_steps=4, per_device_train_batch_size=8,
                      num_generations=4, learning_rate=3e-2, temperature=2.0, report_to=[], use_cpu=True,
                      bf16=False, seed=0, disable_tqdm=True, generation_kwargs={"seed": 7}, use_vllm=True,
                      vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=30, **saving)
    return GRPOTrainer(model_dir, reward_funcs=varied_reward, args=args, train_dataset=addition_dataset(32),
                       callbacks=list(callbacks))


def _weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_a_server_killed_mid_run_stops_it_and_its_checkpoint_resumes_it(server, toy_model, tmp_path):
    """The server dies after step 2's checkpoint: the run stops at its next request with one line naming the server
    and the way out; once a server is back, resuming from that checkpoint ends on the uninterrupted run's weights.
    Kills the module's server: the module's last test."""
    from transformers import TrainerCallback

    reference = resumable_trainer(toy_model, server.url, str(tmp_path / "reference"))
    reference.train()
    expected = _weights(reference)
    del reference

    class KillAfterFirstSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 2:
                server.stop()

    interrupted = resumable_trainer(toy_model, server.url, str(tmp_path / "run"), [KillAfterFirstSave()], save=True)
    with pytest.raises(ConnectionError) as err:
        interrupted.train()
    message = str(err.value)
    assert message.startswith(f"the vLLM server at {server.url} stopped answering") and "\n" not in message, message
    assert "resume_from_checkpoint" in message, message
    assert interrupted.state.global_step == 2
    del interrupted
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert (checkpoint / "trainer_state.json").exists(), sorted(os.listdir(tmp_path / "run"))

    again = Server(toy_model, str(tmp_path / "server_again.log"))  # a fresh server holds the checkpoint's model
    again.wait()
    try:
        resumed = resumable_trainer(toy_model, again.url, str(tmp_path / "run"), save=True)
        resumed.train(resume_from_checkpoint=str(checkpoint))
        assert resumed.state.global_step == 4
        got = _weights(resumed)
    finally:
        again.stop()
    difference = max((got[k] - expected[k]).abs().max().item() for k in expected)
    moved = max((got[k] - torch_load_initial(toy_model)[k]).abs().max().item() for k in expected)
    print(f"\nresumed vs uninterrupted: max |weight difference| {difference:.3g} (moved {moved:.3g})", flush=True)
    assert difference <= 1e-6 and moved > 1e-3, (difference, moved)


def torch_load_initial(model_dir: str) -> dict:
    """The toy model's initial weights, by the state-dict names the trainer's model has."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
