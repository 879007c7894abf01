"""Generation overlapped with training (`max_staleness >= 1`, vLLM server mode): bounded-staleness rollouts.

While optimizer step t trains, the vLLM server already generates the completions of the generation batches that
steps t+1 .. t+k will train on (k = `max_staleness`), with the policy of step t. Only the server's HTTP work runs in
the background: one worker thread of the main process issues the generation requests, one at a time, in the order
they were queued. Everything that talks to the other processes (gathering prompts, broadcasting completions, scoring
and gathering rewards, ZeRO-3's parameter gathers of a weight sync) stays on the main thread of every process, in the
same order everywhere, as under synchronous generation.

The seam is the one HTTP request of TRL's server-mode generation, `VLLMClient.generate` (called by
`VLLMGeneration.generate` on the main process only), and the weight sync before it:

- **prefetch**: when a training generation batch has been generated, every process takes the next batches from the
  dataloader (read ahead by `batch_samples`, the Trainer's `get_batch_samples`), tokenizes their prompts as TRL does
  (`_tokenize_prompts`), gathers them (main thread), and the main process queues the very request TRL's
  `VLLMGeneration.generate` will make for them (the unique prompts of every process, the same sampling parameters),
  plus a trainer's extra requests for the same rows (ReMax's greedy rows: `async_requests`). A prompt selection's
  first request is its first round, planned now (DAPO's over-sampled round, SPEED's screenings: `prefetch_rows`);
  its later rounds depend on the first one's rewards and are requested when they come;
- **answer**: when TRL makes a request, the main process's client (`_answer`) returns the queued request's answer if
  one with exactly these prompts and parameters is queued and young enough, and otherwise sends it through the
  worker (after what is queued: requests never overlap on the server). TRL then broadcasts and scores it as usual;
- **weight sync**: before a generation, when the policy changed, the main process waits until the worker has nothing
  left to do (a sync never overlaps a generation on the server), then TRL's `sync_weights` runs on every process.
  The server's weights are therefore always those of one policy version, `_last_loaded_step`, which every request
  records at the moment it is queued.

Staleness: the policy version is the number of optimizer steps done; a batch generated with version v and trained at
step s has staleness s - v, at most `max_staleness`: an older queued answer is discarded and the request is made
again with the current policy (`async/regenerated`). Logged per generation: `async/staleness` (the same on every
process: broadcast from the main process) and, beside TRL's `sampling/sampling_logp_difference/*` and
`sampling/importance_sampling_ratio/*`, the share of loss tokens (sequence modes: of sequences) whose importance
weight TRL's `vllm_importance_sampling_mode` truncated or masked (`CORRECTED_SHARE`).

Resume: a checkpoint is a synchronisation point. Saving drops what is queued, so the batch after a checkpoint is
generated with the checkpoint's own weights, which a resumed run has too: a resumed run makes the same requests as
the uninterrupted one (the server's sampling is reproducible with a per-request `seed` in `generation_kwargs`).
"""

from __future__ import annotations

import collections
import json
from concurrent.futures import ThreadPoolExecutor

import torch

#: the logged share of loss tokens (or sequences) whose importance-sampling weight was truncated or masked
CORRECTED_SHARE = "sampling/importance_sampling_ratio/corrected_share"
STALENESS = "async/staleness"
REGENERATED = "async/regenerated"


def corrected_share(old_logps: torch.Tensor, sampling_logps: torch.Tensor, ratio: torch.Tensor,
                    mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, total) of the importance weights that a truncation or a mask changed.

    `old_logps`, `sampling_logps`, `mask`: (B, T); `ratio`: TRL's corrected weights, (B, T) per token or (B, 1) per
    sequence. The uncorrected weight is exp(old - sampling) per token, or exp of its sum over the loss tokens per
    sequence (TRL's). A weight counts when the corrected one differs from it by more than 1e-6 relatively. 0-dim
    tensors, for a reduction over the processes."""
    mask = mask.bool()
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    if ratio.shape[-1] == 1 and diff.shape[-1] != 1:
        raw, valid = torch.exp(diff.sum(dim=-1, keepdim=True)), mask.any(dim=-1, keepdim=True)
    else:
        raw, valid = torch.exp(diff), mask
    changed = ((ratio - raw).abs() > 1e-6 * raw.abs().clamp(min=1e-30)) & valid
    return changed.sum().float(), valid.sum().float()


def request_key(prompts: list, params: dict) -> str:
    """The identity of a generation request: its prompts and sampling parameters."""
    return json.dumps([[list(p) for p in prompts], sorted(params.items())], default=str)


class AsyncRollout:
    """The overlapped generation of one trainer (`VariantTrainer` with `max_staleness >= 1`): the read-ahead of the
    dataloader and the prefetched requests on every process, the worker and the queued answers on the main one."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.max_staleness = int(trainer.args.max_staleness)
        self.is_main = trainer.accelerator.is_main_process
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="rollout") if self.is_main else None
        #: main process: request key -> [(future, version)], in the order queued
        self.pending = collections.defaultdict(list)
        #: main process: the versions of the requests answered since the last `take_versions`
        self.answered = []
        #: main process: (global step, n, version, prefetched) of every answered training request (tests, debugging)
        self.history = []
        self.client = None
        self.start()

    # ------------------------------------------------------------------------------------------ the dataloader
    def start(self) -> None:
        """A new `train` call: nothing read ahead, nothing queued."""
        self.drop()
        self.iterator, self.buffer, self.exhausted = None, collections.deque(), False
        self.items, self.read, self.base_step = {}, 0, None
        self.submitted, self.last_prefetch = set(), None

    def batch_samples(self, epoch_iterator, num_batches: int) -> list:
        """The Trainer's `num_batches` next items of `epoch_iterator`, after reading `max_staleness` generation
        batches further ahead (kept in `items` by their index since this `train` call began: the item the Trainer
        trains at micro-step m is item m - `base_step`). Every process reads alike (its dataloader has the same
        length), so every process prefetches alike."""
        if epoch_iterator is not self.iterator:
            self.iterator, self.buffer, self.exhausted = epoch_iterator, collections.deque(), False
        if self.base_step is None:
            self.base_step = self.trainer._step
        ahead = self.max_staleness * self.generate_every()
        while not self.exhausted and len(self.buffer) < num_batches + ahead:
            try:
                item = next(epoch_iterator)
            except StopIteration:
                self.exhausted = True
                break
            self.items[self.read] = item
            self.read += 1
            self.buffer.append(item)
        return [self.buffer.popleft() for _ in range(min(num_batches, len(self.buffer)))]

    def generate_every(self) -> int:
        """Micro-steps between two generation batches (TRL's `_prepare_inputs`)."""
        return self.trainer.args.steps_per_generation * self.trainer.num_iterations

    # ------------------------------------------------------------------------------------------ around a generation
    def before_generation(self) -> None:
        """Every process, before a generation: a changed policy is synced once the worker is idle (never during a
        generation on the server), as TRL's `_generate_single_turn` would sync it."""
        t = self.trainer
        self._install_client()
        self.answered = []  # a later request of the last generation (ReMax's greedy rows) is not this one's
        if t.state.global_step == t._last_loaded_step:
            return
        self.wait_idle()
        from trl.extras.profiling import profiling_context

        with profiling_context(t, "sync_weights"):
            t.vllm_generation.sync_weights()
        t._last_loaded_step = t.state.global_step

    def after_generation(self) -> None:
        """Every process, after a generation of TRL's: log the staleness of what was answered (the main process's
        number, broadcast) and, in training, queue the next batches' requests (once a generation batch)."""
        from accelerate.utils import broadcast_object_list

        t = self.trainer
        versions = self.take_versions()
        box = [min(versions) if versions else t.state.global_step]
        if t.accelerator.num_processes > 1:
            broadcast_object_list(box, from_process=0)
        mode = "train" if t.model.training else "eval"
        t._metrics[mode][STALENESS].append(float(t.state.global_step - box[0]))
        if t.model.training and self.last_prefetch != t._step and t.prefetches_generation():
            self.last_prefetch = t._step
            self.prefetch()

    def prefetch(self) -> None:
        """Queue the requests of the generation batches `max_staleness` ahead of the current one that are read,
        not queued yet, and trained before `max_steps`."""
        t = self.trainer
        if self.base_step is None:
            return
        every = self.generate_every()
        current = t._step - self.base_step
        for j in range(1, self.max_staleness + 1):
            index = current + j * every
            if index in self.submitted:
                continue
            if index not in self.items:
                break  # the epoch's end: the next epoch's first batch is generated when it comes
            trained_at = (self.base_step + index) // t.args.gradient_accumulation_steps
            if trained_at >= t.state.max_steps > 0 or trained_at - t._last_loaded_step > self.max_staleness:
                break  # past the run's end, or too old by the time it trains (steps_per_generation > accumulation)
            self.submitted.add(index)
            self.submit(self.items[index], self.base_step + index)
        for old in [i for i in self.items if i < current]:
            del self.items[old]

    def submit(self, rows: list, step: int) -> None:
        """Gather the requests TRL will make first for `rows` (this process's rows of the generation batch of
        micro-step `step`; a prompt selection's first round planned ahead: `prefetch_rows`) and queue them on the
        main process. A batch with images is left to TRL (its request carries image features)."""
        from accelerate.utils import gather_object

        t = self.trainer
        rows, n = t.prefetch_rows(rows, step)
        prompt_ids, images, _ = t._tokenize_prompts([x["prompt"] for x in rows])
        local = None if images is not None else t.async_requests(prompt_ids, n)
        everyone = gather_object([local]) if t.accelerator.num_processes > 1 else [local]
        if any(requests is None for requests in everyone) or not self.is_main:
            return
        for i, (_, n, overrides) in enumerate(everyone[0]):
            prompts = [p for requests in everyone for p in requests[i][0]][::n]
            params = {**self.sampling_params(n), **overrides}
            future = self.executor.submit(self._original, prompts=prompts, features=None, **params)
            self.pending[request_key(prompts, params)].append((future, t._last_loaded_step))

    def sampling_params(self, n: int) -> dict:
        """The sampling parameters TRL's `VLLMGeneration.generate` sends the server for `n` completions a prompt."""
        g = self.trainer.vllm_generation
        return {"n": n, "repetition_penalty": g.repetition_penalty, "temperature": g.temperature, "top_p": g.top_p,
                "top_k": g.top_k, "min_p": 0.0 if g.min_p is None else g.min_p,
                "max_tokens": g.max_completion_length, "logprobs": g.logprobs,
                "structured_outputs_regex": g.structured_outputs_regex, "generation_kwargs": g.generation_kwargs}

    # ------------------------------------------------------------------------------------------ the main process
    def _install_client(self) -> None:
        client = getattr(self.trainer.vllm_generation, "vllm_client", None)
        if client is None or client is self.client:
            return
        self.client, self._original = client, client.generate
        client.generate = self._answer

    def _answer(self, prompts, features=None, **params):
        """TRL's request: the queued answer of the same request when it is at most `max_staleness` steps old, else
        the request sent now, through the worker (after whatever is queued)."""
        t = self.trainer
        step = t.state.global_step
        if features is None and t.model.training:
            queued = self.pending.get(request_key(prompts, params), [])
            while queued:
                future, version = queued.pop(0)
                output = future.result()
                if step - version <= self.max_staleness:
                    self._record(version, params, True)
                    return output
                t._metrics["train"][REGENERATED].append(1.0)
        version = t._last_loaded_step
        output = self.executor.submit(self._original, prompts=prompts, features=features, **params).result()
        self._record(version, params, False)
        return output

    def _record(self, version: int, params: dict, prefetched: bool) -> None:
        self.answered.append(version)
        if self.trainer.model.training:
            self.history.append((self.trainer.state.global_step, params.get("n"), version, prefetched))

    def take_versions(self) -> list:
        versions, self.answered = self.answered, []
        return versions

    def wait_idle(self) -> None:
        """Main process: wait for every queued request; drop those too old to be trained on any more."""
        if not self.is_main:
            return
        oldest = self.trainer.state.global_step - self.max_staleness
        for key in list(self.pending):
            kept = []
            for future, version in self.pending[key]:
                future.exception()  # waits; an error is raised where the answer is taken
                if version >= oldest:
                    kept.append((future, version))
            if kept:
                self.pending[key] = kept
            else:
                del self.pending[key]

    def drop(self) -> None:
        """Wait for and discard everything queued (a checkpoint, the end of `train`)."""
        if self.is_main:
            for queued in self.pending.values():
                for future, _ in queued:
                    future.exception()
            self.pending.clear()
        if hasattr(self, "submitted"):
            self.submitted.clear()
