"""The one wrapper through which a trainer changes an HF `generate` call: extra logits processors (ReMax's greedy
rows) and the sampling-time log-probabilities of the sampled tokens, recorded during the call.

Why record them. The estimators with a KL in the reward (RLOO with `beta > 0`, REINFORCE++, ReMax/TTRL with
`kl_in_reward_coef`, PPO, VAPO) need `log pi_old(y_t)`, the log-probability of every sampled token under the policy
that sampled it. vLLM returns them (TRL keeps them for its importance-sampling correction); HF `generate` returns
none, so the trainers ran one more no-grad forward pass of the policy over the whole batch to get them. Here they
are taken from the forward passes `generate` runs anyway.

What is recorded: `log_softmax(z_t / T)[y_t]`, with `z_t` the model's raw logits at step t (before every logits
processor: repetition penalty, no-repeat n-grams, min length, ...; before temperature, top-k, top-p and min-p warping)
and `T` the trainer's `temperature`. That is what `GRPOTrainer._get_per_token_logps_and_entropies` computes on the full
sequence (TRL's fused LM head divides the logits by the temperature and takes the log-softmax over the whole
vocabulary), so the two agree up to the rounding of the kernel calls, which are not the same: `generate` runs the model
on the prompt, then on one position at a time against the KV cache, the forward once over the whole sequence. Measured
on CPU on the toy model (`bench/sampling_logps_bound.py`: prompts padded by 0-6 words, 4-32 new tokens): at most 5.2e-6
per token in fp32, at most 0.072 per token under bf16 autocast (0.28 on SmolLM2-135M), whose kernels round by call
shape, padded or not (docs/reliability.md has the table, SmolLM2-135M's included). On a GPU the KV-cached decoding
kernels differ from the training forward's too: the same training/inference mismatch that TRL accepts for vLLM's
log-probs.

How. transformers runs the user's logits processors *after* its own (repetition penalty, ...), so a processor only
sees penalised scores. Two pieces work together:

- a forward hook on the model keeps a float32 copy of the last position's logits of the newest forward pass
  (B x V; only the newest is kept);
- a logits processor that changes nothing serves as the step clock: `generate` calls it once per decoding step,
  right after that step's forward pass, with `input_ids` whose last column is the token sampled at the previous step.
  It pairs that token with the logits kept at the previous step. The last token is paired after `generate` returns.

Memory: two (B, V) float32 tensors at a time plus (B,) per step; never (B, T, V) (unlike `output_scores` or
`output_logits`). A self-check compares the tokens paired during the call with the returned sequences: any
disagreement (a row count that changed, rows reordered, a model whose forward returns no `logits`, a compiled
forward that skips the hook) gives up the recording for that call (NaN), and the trainer falls back to the forward
pass.

Where the recorded numbers are the training forward's, and where they cannot be (the trainer then does not use them,
`VariantTrainer.sampling_logps`):

- decoding modes (`unrecordable_reason`): only plain sampling and greedy decoding run one forward per token on the
  rows they return. Beam search (`num_beams > 1`) keeps batch x beams rows and reorders them, assisted / prompt-lookup
  decoding scores several candidate tokens per forward, and `num_return_sequences > 1` changes the row count: their
  steps are not one (row, token) pair per forward, so nothing is recorded.
- positions (`relative_positions`): `generate` derives `position_ids` from the attention mask (a left-padded row
  starts at 0), TRL's training and reference forwards pass none (positions count from the first column, pads
  included). With rotary embeddings only position differences enter attention and the shift cancels in exact
  arithmetic, not in rounding (7e-3 per token under bf16 autocast on CPU): for such models a recording `generate`
  is given the forward's positions (`patched_generate(column_positions=True)`), which samples from the same
  distribution with the forward's rounding of the rotation. Models that derive their positions from their image
  inputs (`computes_own_positions`: Qwen2-VL's M-RoPE) are given none: arange positions would override the image-aware
  ones (1.1e-4 per token off on a tiny Qwen2-VL, and another distribution); their `generate` and forward both count a
  row's positions from its first token, so they agree (a text-only left-padded batch up to the rotation's rounding,
  as above). With a learned or sinusoidal position table (GPT-2, GPT-Neo,
  GPT-BigCode, OPT, ...) or a RoPE whose frequencies depend on the largest position ("dynamic", "longrope") the
  shift does not cancel, and giving `generate` the forward's positions would change what is sampled (away from
  TRL's, to positions the model never sees at inference); the KL in the reward must compare like with like (the
  reference's log-probs come from the forward), so for such models a batch with left padding takes the forward.
- precision: the training forward runs under accelerate's autocast (mixed precision). A prepared plain model's
  forward is wrapped in it, so `generate` runs under it too; PEFT's `generate` runs the base model's forward, outside
  it. The trainer runs the recording `generate` calls under the same autocast (`VariantTrainer._generate_single_turn`).
  `cast_lm_head_to_fp32` under autocast (the training forward's LM head in fp32 outside autocast, `generate`'s in
  bf16 inside it) is not recorded.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.configuration_utils import GenerationMode

#: decoding modes that run one forward per generated token on the rows they return (see the module docstring)
RECORDABLE_MODES = (GenerationMode.SAMPLE, GenerationMode.GREEDY_SEARCH)
#: rotary types whose frequencies depend on the largest position id of the batch (a shift can change them)
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def unrecordable_reason(generation_config: GenerationConfig | None) -> str | None:
    """Why `generate` with this config cannot be recorded (a short phrase), or None when it can: any decoding mode
    but sampling and greedy decoding (beam search, assisted / prompt-lookup decoding, ...), or more than one returned
    sequence per input row."""
    if generation_config is None:
        return None
    mode = generation_config.get_generation_mode()
    if mode not in RECORDABLE_MODES:
        return f"decoding mode {mode.value!r}"
    if (generation_config.num_return_sequences or 1) > 1:
        return f"num_return_sequences={generation_config.num_return_sequences}"
    return None


def relative_positions(model: torch.nn.Module) -> bool:
    """Whether the model only sees position differences, so that shifting every position id of a row by the same
    amount leaves its logits unchanged (up to float rounding): rotary embeddings whose frequencies do not depend on
    the sequence length. False for learned or sinusoidal position tables (GPT-2, OPT, ...), for "dynamic" and
    "longrope" RoPE, and for models this cannot tell (ALiBi, a rotary module under another name): a False only costs
    the forward pass for left-padded batches."""
    ropes = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    for rope in ropes:
        kinds = getattr(rope, "rope_type", "default")
        kinds = kinds.values() if isinstance(kinds, dict) else [kinds]  # per layer type (Gemma 3, ...)
        if any(kind in LENGTH_DEPENDENT_ROPE for kind in kinds):
            return False
    return bool(ropes)


def computes_own_positions(model: torch.nn.Module) -> bool:
    """Whether the model derives its position ids from its inputs itself, images included (M-RoPE: Qwen2-VL,
    Qwen2.5-VL, ... compute 3-D positions with `get_rope_index` from `image_grid_thw` and the attention mask, counted
    from each row's first token, in `generate` as in the forward): such a model must not be given positions."""
    return any(callable(getattr(m, "get_rope_index", None)) for m in model.modules())


def token_logps(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """`log_softmax(logits / temperature)[tokens]` in float32: (B, V), (B,) -> (B,)."""
    z = logits.to(torch.float32) / temperature
    return z.gather(1, tokens.long().unsqueeze(1)).squeeze(1) - torch.logsumexp(z, dim=-1)


class SamplingLogpsRecorder(LogitsProcessor):
    """Records `token_logps(raw logits of step t, token sampled at step t, temperature)` during one `generate` call.

    Used as both a forward hook (`hook`) on the module that returns the logits and a logits processor (the step
    clock: `__call__` returns the scores unchanged). `finish(sequences, prompt_width)` gives the (B, n) log-probs of
    the n generated columns, or None when the recording is inconsistent (see the module docstring).
    """

    def __init__(self, temperature: float):
        self.temperature = float(temperature)
        self._latest = None  # (B, V) logits of the newest forward pass, not yet claimed by a step
        self._previous = None  # (B, V) logits of the step whose token is sampled but not yet seen
        self._logps = []  # (B,) per step
        self._tokens = []  # (B,) per step: the tokens the log-probs are of, checked against the output
        self.broken = False

    def hook(self, module, args, output):
        logits = getattr(output, "logits", None)
        if logits is None or logits.dim() != 3:
            self.broken = True
            return
        # a copy: a view would keep the whole (B, L, V) prefill logits alive
        self._latest = logits[:, -1].detach().to(torch.float32, copy=True)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._previous is not None and self._previous.shape[0] != input_ids.shape[0]:
            self.broken = True  # never paired: rows of another count (no crash mid-call, the call gives up)
        elif self._previous is not None:
            self._pair(self._previous, input_ids[:, -1])
        elif self._logps:  # a step whose forward pass the hook did not see
            self.broken = True
        if self._latest is None or self._latest.shape[0] != input_ids.shape[0]:
            self.broken = True
        self._previous, self._latest = self._latest, None
        return scores

    def _pair(self, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        tokens = tokens.to(logits.device)
        self._logps.append(token_logps(logits, tokens, self.temperature))
        self._tokens.append(tokens)

    def finish(self, sequences: torch.Tensor, prompt_width: int) -> torch.Tensor | None:
        """(B, n) log-probs of `sequences[:, prompt_width:]` (float32), or None when they cannot be trusted."""
        generated = sequences[:, prompt_width:]
        n = generated.shape[1]
        rows = generated.shape[0]
        # a changed row count (beams, several sequences per row) is checked before anything is paired
        if any(t.shape[0] != rows for t in (self._previous, self._latest, *self._tokens) if t is not None):
            self.broken = True
        if not self.broken and len(self._logps) == n - 1 and self._previous is not None:
            # the last step's token is known only now
            self._pair(self._previous, generated[:, -1])
        self._previous = self._latest = None
        # more steps than columns: `generate` undid speculative steps (deferred stop checks); they are dropped
        if self.broken or len(self._logps) < n:
            return None
        if n == 0:
            return torch.zeros(generated.shape, dtype=torch.float32, device=generated.device)
        tokens = torch.stack(self._tokens[:n], dim=1)
        if tokens.shape != generated.shape or not torch.equal(tokens, generated.to(tokens.device)):
            return None  # rows were reordered or replaced (beam search, assisted decoding, ...)
        return torch.stack(self._logps[:n], dim=1)


def logits_module(model) -> torch.nn.Module:
    """The module whose forward returns the logits during `model.generate` (PEFT's `generate` runs the base model's
    forward, not the wrapper's)."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


@contextlib.contextmanager
def patched_generate(model, processors=(), temperature: float | None = None, column_positions: bool = False):
    """Route `model.generate` through extra logits `processors` and, when `temperature` is given, record the
    sampling-time log-probs (`SamplingLogpsRecorder`), for the duration of the block. `column_positions` passes
    `position_ids` counted from the first column, pads included (TRL's forwards pass none, so the model counts so),
    instead of `generate`'s count from each row's first token: only for models with `relative_positions`.

    TRL 1.16 has no config route for a logits processor (`GenerationConfig` refuses one, `generation_kwargs` is not
    forwarded on transformers 5), and `GRPOTrainer._generate_single_turn` calls `unwrapped_model.generate(...)`
    itself. Shadowing the bound method with an instance attribute touches this one model object only, and the
    attribute is removed on exit, whatever happens. Yields a list that gets one entry per `generate` call: the
    recorded (B, n) log-probs of the generated columns, or None (not asked for, or not trustworthy). A caller can
    tell from its length that TRL stopped calling `generate` (the processors were then not applied).
    """
    had_own = "generate" in model.__dict__
    own = model.__dict__.get("generate")
    inner = model.generate
    calls = []

    def generate(*args, **kwargs):
        merged = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
        merged.extend(processors)
        recorder = handle = None
        if temperature is not None:
            recorder = SamplingLogpsRecorder(temperature)
            merged.append(recorder)
            handle = logits_module(model).register_forward_hook(recorder.hook)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if column_positions and isinstance(input_ids, torch.Tensor) and kwargs.get("position_ids") is None:
            # positions counted from the first column, pads included, as in TRL's forwards (see the docstring)
            kwargs["position_ids"] = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        try:
            out = inner(*args, logits_processor=merged, **kwargs)
        finally:
            if handle is not None:
                handle.remove()
        logps = None
        if recorder is not None:
            sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
            if isinstance(sequences, torch.Tensor) and isinstance(input_ids, torch.Tensor):
                logps = recorder.finish(sequences, input_ids.shape[1])
                if sequences.shape[0] != input_ids.shape[0]:  # rows are not the prompts' rows any more
                    logps = None
        calls.append(logps)
        return out

    model.__dict__["generate"] = generate
    try:
        yield calls
    finally:
        if had_own:
            model.__dict__["generate"] = own
        else:
            del model.__dict__["generate"]


def rows_to_lists(logps: torch.Tensor | None, completion_ids: list[list[int]]) -> list[list[float]]:
    """The recorded (B, n) log-probs cut to each completion's length (TRL cuts the ids after the first EOS), as the
    lists TRL's generation returns; NaN rows when nothing trustworthy was recorded (the trainer then falls back to
    the forward pass, and TRL's tool loop can still append to them)."""
    if logps is None or logps.shape[0] != len(completion_ids):
        return [[float("nan")] * len(ids) for ids in completion_ids]
    rows = logps.cpu().tolist()
    return [row[: len(ids)] for row, ids in zip(rows, completion_ids)]
