"""Experience formats: what one generated sequence is, and the two batch layouts trainers consume.

`Sample`       one generated sequence, as an engine returns it (plus its reward).
`PaddedBatch`  `[B, L]` rows, right padded -- what a plain HF forward takes.
`PackedBatch`  every sequence concatenated into `[N]` with `cu_seqlens` -- padding-free, what a
               varlen (flash-attention style) forward takes, and the cheap thing to move around.
How a rollout is cut into micro-batches: rlhf_orch.transfer.micro_batches; the engines' growing
packed buffers: rlhf_orch.transfer.packed_buffer.

Alignment of per-token fields (`old_logprobs`, `ref_logprobs`, `values`, `advantages`, `returns`,
`engine_logprobs`, ...): position `t` holds the value for the *prediction of token t+1* from the
prefix ending at token `t` -- the position a causal LM's logits come out at. `action_mask` is 1
exactly where token `t+1` is a response token of the same sequence. So for a sequence with `p`
prompt and `r` response tokens the action positions are `p-1 .. p+r-2`.

Empty responses (0 response tokens) are KEPT, with an all-zero action mask: they contribute no
token to any masked loss, their score credits no action (see `ppo_math.token_rewards`), but they
keep their place, index and count -- dropping them would silently change batch sizes that the
data-parallel shard and micro-batch arithmetic depend on. Prompts must be non-empty: the first
response token has to be predicted from something.

Conversions carry every in-sequence position. Positions that are not a next-token prediction
inside a sequence -- right padding, and each sequence's last token in the packed layout -- are
not carried and read 0 after a conversion, which is what makes padded <-> packed round trips exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields as dataclass_fields
from typing import Callable, Iterable, Sequence, TypeVar

import torch
from torch import Tensor

ENGINE_LOGPROBS = "engine_logprobs"  # field name under which Sample.engine_logprobs travel
# Multi-turn trajectories (`env`): per response token, 1 for the model's tokens and 0 for an
# observation's. It travels as a field like any other (every transfer strategy carries fields) and
# the trainer folds it into `action_mask` on arrival (`apply_loss_mask`): observation tokens are
# context, never trained on, skipped by GAE and every loss aggregation like holes.
LOSS_MASK = "loss_mask"
# `env=agent` with env.sampling=call: per response token, the temperature it was sampled at (an
# agent's call may set its own); 0 where it is the run's (algo.temperature). The trainers score every
# token at its own (rlhf_orch.trainer.forward).
SAMPLING_TEMPERATURE = "sampling_temperature"
# `env.reward=per_turn`: per response token, the environment's reward of a model turn on that turn's
# last token (0 elsewhere). Estimators that read rewards per token (PPO's GAE, REINFORCE++'s
# return-to-go) place them there; the rest of the sample's score goes on its last token
# (`ppo_math.token_rewards`).
TURN_REWARDS = "turn_rewards"


def apply_loss_mask(batch: "PaddedBatch | PackedBatch") -> "PaddedBatch | PackedBatch":
    """The batch with observation tokens taken out of `action_mask` (a new tensor: a batch may be a
    view of an object-store buffer, never written into); batches without the field are unchanged."""
    mask = batch.fields.pop(LOSS_MASK, None)
    if mask is not None:
        batch.action_mask = batch.action_mask & (mask > 0.5)
    return batch


def model_turn_spans(action: Sequence[int | bool]) -> list[tuple[int, int]]:
    """[start, end) of each contiguous run of model tokens in a response's action flags: one per
    model turn of a multi-turn trajectory (observations break the runs), one for a single turn."""
    spans: list[tuple[int, int]] = []
    for k, a in enumerate(action):
        if a and (k == 0 or not action[k - 1]):
            spans.append((k, k + 1))
        elif a:
            spans[-1] = (spans[-1][0], k + 1)
    return spans


BatchT = TypeVar("BatchT", "PaddedBatch", "PackedBatch")


# --------------------------------------------------------------------------- one sequence
@dataclass
class Sample:
    """One generated sequence (token ids as lists or 1-D tensors)."""

    prompt_ids: list[int] | Tensor
    response_ids: list[int] | Tensor
    reward: float
    engine_logprobs: list[float] | Tensor | None = None  # per response token, from vLLM
    weight_version: int = 0  # policy version the engine generated it with
    index: int = 0  # position in the rollout, so order survives sharding and streaming
    truncated: bool = False  # generation stopped at max_tokens (not carried by the batch layouts)
    # Further per-response-token values (e.g. a full PPO experience: old/ref logprobs, values,
    # advantages, returns), one entry per response token; they become `fields[name]` of a batch.
    fields: dict[str, list[float] | Tensor] = field(default_factory=dict)
    # pipeline=async (not carried by the batch layouts either): a weight update reached it while it
    # generated, and the weight version averaged over its tokens (None: weight_version, its first token's)
    interrupted: bool = False
    token_version_mean: float | None = None
    version_spans: tuple[tuple[int, int, int], ...] | None = None  # (start, end, version) over the response


def _as_ids(ids: list[int] | Tensor) -> Tensor:
    return torch.as_tensor(ids, dtype=torch.long).reshape(-1)


def _as_floats(values: list[float] | Tensor) -> Tensor:
    return torch.as_tensor(values, dtype=torch.float32).reshape(-1)


# --------------------------------------------------------------------------- shared indexing
def _token_coordinates(seq_lens: Tensor) -> tuple[Tensor, Tensor]:
    """For the packed layout of sequences with `seq_lens`: (sequence id, offset in it) per token."""
    seq_id = torch.repeat_interleave(torch.arange(len(seq_lens)), seq_lens)
    starts = torch.cumsum(seq_lens, 0) - seq_lens
    return seq_id, torch.arange(int(seq_lens.sum())) - starts[seq_id]


def _cu_seqlens(seq_lens: Tensor) -> Tensor:
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(seq_lens, 0)
    return cu


def _check_ranges(ranges: Iterable[range], n: int) -> list[range]:
    checked = list(ranges)
    for r in checked:
        if r.step != 1 or not 0 <= r.start <= r.stop <= n:
            raise ValueError(f"split needs contiguous ranges within [0, {n}], got {r}")
    return checked


def _tensors_nbytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.nbytes for t in tensors)


# --------------------------------------------------------------------------- padded layout
@dataclass
class PaddedBatch:
    """Right-padded rows. `fields[name]` are `[B, L-1]`, aligned with `action_mask`."""

    input_ids: Tensor  # [B, L] long, prompt + response, right padded with pad_id
    attention_mask: Tensor  # [B, L] long (what HF models expect), 1 on real tokens
    action_mask: Tensor  # [B, L-1] bool, 1 where token t+1 is a response token
    position_ids: Tensor  # [B, L] long, 0.. per row; 0 on padding
    scores: Tensor  # [B] float32, sequence rewards
    indices: Tensor  # [B] long, Sample.index
    weight_versions: Tensor  # [B] long, Sample.weight_version
    fields: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rows, length = self.input_ids.shape
        expected = (rows, max(length - 1, 0))
        for name, tensor in {"action_mask": self.action_mask, **self.fields}.items():
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {expected}")

    # -- construction and conversion
    @classmethod
    def from_samples(cls, samples: Sequence[Sample], pad_id: int, pad_to: int | None = None) -> PaddedBatch:
        """Pad `samples` (kept in the given order) to the longest, or to `pad_to` tokens."""
        return PackedBatch.from_samples(samples).to_padded(pad_id, pad_to)

    def to_packed(self) -> PackedBatch:
        """The same sequences without padding (exact inverse of `PackedBatch.to_padded`)."""
        seq_lens = self.seq_lens
        columns = torch.arange(self.input_ids.shape[1])
        if not torch.equal(self.attention_mask.bool(), columns < seq_lens[:, None]):
            raise ValueError("to_packed expects right padding: attention_mask must be 1..1 0..0")
        real = self.attention_mask.bool()
        seq_id, offset = _token_coordinates(seq_lens)
        # Packed tokens that predict a next token of their own sequence (all but each last one).
        predicts = offset < seq_lens[seq_id] - 1

        def gather(padded: Tensor) -> Tensor:
            packed = padded.new_zeros(len(seq_id))
            packed[predicts] = padded[seq_id[predicts], offset[predicts]]
            return packed

        return PackedBatch(
            input_ids=self.input_ids[real],
            cu_seqlens=_cu_seqlens(seq_lens),
            position_ids=self.position_ids[real],
            action_mask=gather(self.action_mask),
            scores=self.scores,
            indices=self.indices,
            weight_versions=self.weight_versions,
            fields={name: gather(values) for name, values in self.fields.items()},
        )

    def add_response_field(self, name: str, per_sample: Sequence[Tensor | list[float]]) -> None:
        """Store per-sample values over the real response positions as `fields[name]`."""
        self.fields[name] = _scatter_response_values(self.action_mask, per_sample, self.response_lens)

    def to_samples_fields(self) -> list[dict[str, Tensor]]:
        """Per sample, every field at its real response positions only (1-D, response length)."""
        return _response_values_per_sample(self.action_mask, self.fields, self.response_lens)

    def to_samples(self) -> list[Sample]:
        return self.to_packed().to_samples()

    # -- slicing (by sequence)
    def split(self, ranges: Iterable[range]) -> list[PaddedBatch]:
        """Row slices (views, no copy). `clone()` one before pickling it to another process."""
        return [self._rows(slice(r.start, r.stop)) for r in _check_ranges(ranges, len(self))]

    def select(self, seq_indices: Sequence[int]) -> PaddedBatch:
        """The given rows, in the given order (a copy)."""
        return self._rows(torch.as_tensor(list(seq_indices), dtype=torch.long))

    def _rows(self, rows: slice | Tensor) -> PaddedBatch:
        return PaddedBatch(
            input_ids=self.input_ids[rows],
            attention_mask=self.attention_mask[rows],
            action_mask=self.action_mask[rows],
            position_ids=self.position_ids[rows],
            scores=self.scores[rows],
            indices=self.indices[rows],
            weight_versions=self.weight_versions[rows],
            fields={name: values[rows] for name, values in self.fields.items()},
        )

    def clone(self) -> PaddedBatch:
        """Own storage for every tensor (pickling a view would ship its whole parent storage)."""
        return _map_tensors(self, lambda t: t.clone())

    def to(self, device: torch.device | str) -> PaddedBatch:
        return _map_tensors(self, lambda t: t.to(device))

    # -- sizes
    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_lens(self) -> Tensor:
        return self.attention_mask.sum(1)

    @property
    def response_lens(self) -> Tensor:
        return self.action_mask.sum(1)

    @property
    def sequence_ids(self) -> Tensor:
        """`[B, L-1]`, shaped like `action_mask`: each position's sequence (its row)."""
        rows = torch.arange(self.input_ids.shape[0], device=self.input_ids.device)
        return rows[:, None].expand(self.action_mask.shape)

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return int(self.attention_mask.sum())

    @property
    def nbytes(self) -> int:
        return _tensors_nbytes(_all_tensors(self))


# --------------------------------------------------------------------------- packed layout
@dataclass
class PackedBatch:
    """All sequences concatenated. `fields[name]` are `[N]`, aligned with `action_mask`."""

    input_ids: Tensor  # [N] long
    cu_seqlens: Tensor  # [B+1] int32, sequence b is input_ids[cu[b]:cu[b+1]]
    position_ids: Tensor  # [N] long, restarting at 0 per sequence
    action_mask: Tensor  # [N] bool, 1 where the NEXT token of the same sequence is a response token
    scores: Tensor  # [B] float32
    indices: Tensor  # [B] long
    weight_versions: Tensor  # [B] long
    fields: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        expected = tuple(self.input_ids.shape)
        for name, tensor in {"action_mask": self.action_mask, **self.fields}.items():
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {expected}")

    # -- construction and conversion
    @classmethod
    def from_samples(cls, samples: Sequence[Sample]) -> PackedBatch:
        """Concatenate `samples` in the given order. `engine_logprobs` become a field if every
        sample has them (a mix is refused: a field must cover the whole batch)."""
        if not samples:
            raise ValueError("cannot build a batch from zero samples")
        prompts = [_as_ids(s.prompt_ids) for s in samples]
        responses = [_as_ids(s.response_ids) for s in samples]
        for sample, prompt in zip(samples, prompts):
            if len(prompt) == 0:
                raise ValueError(
                    f"sample index={sample.index} has an empty prompt; the first response token "
                    "must be predicted from at least one prompt token"
                )
        prompt_lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        response_lens = torch.tensor([len(r) for r in responses], dtype=torch.long)
        seq_lens = prompt_lens + response_lens
        seq_id, offset = _token_coordinates(seq_lens)
        action_mask = (offset >= prompt_lens[seq_id] - 1) & (offset < seq_lens[seq_id] - 1)
        batch = cls(
            input_ids=torch.cat([t for p, r in zip(prompts, responses) for t in (p, r)]),  # one copy
            cu_seqlens=_cu_seqlens(seq_lens),
            position_ids=offset,
            action_mask=action_mask,
            scores=torch.tensor([float(s.reward) for s in samples], dtype=torch.float32),
            indices=torch.tensor([s.index for s in samples], dtype=torch.long),
            weight_versions=torch.tensor([s.weight_version for s in samples], dtype=torch.long),
        )
        engine_logprobs = [s.engine_logprobs for s in samples]
        action_positions = action_mask.nonzero().squeeze(1)  # shared by every field below
        with_logprobs = sum(lp is not None for lp in engine_logprobs)
        # Fields are scattered with the response lengths known here (recomputing them from the
        # mask per field made this the slowest part of packing a rollout).
        if with_logprobs == len(samples):
            batch.fields[ENGINE_LOGPROBS] = _scatter_response_values(
                action_mask, engine_logprobs, response_lens, action_positions
            )
        elif with_logprobs:
            raise ValueError(
                f"{with_logprobs} of {len(samples)} samples carry engine_logprobs; "
                "either all samples of a batch carry them or none does"
            )
        names = set(samples[0].fields)
        for sample in samples:
            if set(sample.fields) != names:
                raise ValueError(
                    f"sample index={sample.index} carries fields {sorted(sample.fields)}, the first sample "
                    f"{sorted(names)}; every sample of a batch must carry the same fields"
                )
        for name in sorted(names):
            batch.fields[name] = _scatter_response_values(
                action_mask, [s.fields[name] for s in samples], response_lens, action_positions
            )
        return batch

    @classmethod
    def concat(cls, batches: Sequence[PackedBatch]) -> PackedBatch:
        """One batch holding `batches`' sequences in order (they must carry the same fields)."""
        if not batches:
            raise ValueError("cannot concatenate zero batches")
        names = set(batches[0].fields)
        if any(set(b.fields) != names for b in batches):
            raise ValueError(f"batches carry different fields: {[sorted(b.fields) for b in batches]}")
        return cls(
            input_ids=torch.cat([b.input_ids for b in batches]),
            cu_seqlens=_cu_seqlens(torch.cat([b.seq_lens for b in batches])),
            position_ids=torch.cat([b.position_ids for b in batches]),
            action_mask=torch.cat([b.action_mask for b in batches]),
            scores=torch.cat([b.scores for b in batches]),
            indices=torch.cat([b.indices for b in batches]),
            weight_versions=torch.cat([b.weight_versions for b in batches]),
            fields={name: torch.cat([b.fields[name] for b in batches]) for name in sorted(names)},
        )

    def to_padded(self, pad_id: int, pad_to: int | None = None) -> PaddedBatch:
        """Right-pad to the longest sequence, or to `pad_to` tokens (must fit every sequence)."""
        seq_lens = self.seq_lens
        longest = int(seq_lens.max()) if len(seq_lens) else 0
        length = longest if pad_to is None else pad_to
        if length < longest:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest sequence ({longest})")
        rows = len(seq_lens)
        seq_id, offset = _token_coordinates(seq_lens)
        predicts = offset < seq_lens[seq_id] - 1

        def place(packed: Tensor, width: int, fill: int = 0) -> Tensor:
            padded = packed.new_full((rows, width), fill)
            padded[seq_id, offset] = packed
            return padded

        def place_predictions(packed: Tensor) -> Tensor:
            padded = packed.new_zeros((rows, max(length - 1, 0)))
            padded[seq_id[predicts], offset[predicts]] = packed[predicts]
            return padded

        return PaddedBatch(
            input_ids=place(self.input_ids, length, pad_id),
            attention_mask=place(torch.ones_like(self.input_ids), length),
            action_mask=place_predictions(self.action_mask),
            position_ids=place(self.position_ids, length),
            scores=self.scores,
            indices=self.indices,
            weight_versions=self.weight_versions,
            fields={name: place_predictions(values) for name, values in self.fields.items()},
        )

    def add_response_field(self, name: str, per_sample: Sequence[Tensor | list[float]]) -> None:
        """Store per-sample values over the real response positions as `fields[name]`."""
        self.fields[name] = _scatter_response_values(self.action_mask, per_sample, self.response_lens)

    def to_samples_fields(self) -> list[dict[str, Tensor]]:
        """Per sample, every field at its real response positions only (1-D, response length)."""
        return _response_values_per_sample(self.action_mask, self.fields, self.response_lens)

    def to_samples(self) -> list[Sample]:
        """Back to `Sample`s (ids as 1-D tensors); `engine_logprobs` from that field if present."""
        response_lens = self.response_lens.tolist()
        per_sample_fields = self.to_samples_fields()
        samples = []
        for b, tokens in enumerate(torch.split(self.input_ids, self.seq_lens.tolist())):
            prompt_len = len(tokens) - response_lens[b]
            samples.append(
                Sample(
                    prompt_ids=tokens[:prompt_len].clone(),  # own storage, see `split`
                    response_ids=tokens[prompt_len:].clone(),
                    reward=float(self.scores[b]),
                    engine_logprobs=per_sample_fields[b].get(ENGINE_LOGPROBS),
                    weight_version=int(self.weight_versions[b]),
                    index=int(self.indices[b]),
                    fields={k: v for k, v in per_sample_fields[b].items() if k != ENGINE_LOGPROBS},
                )
            )
        return samples

    # -- slicing (by sequence)
    def split(self, ranges: Iterable[range]) -> list[PackedBatch]:
        """Contiguous sequence ranges -> batches whose token tensors are views (no copy).

        Pickling a view ships its whole parent storage: `clone()` a part before sending it to
        another process.
        """
        parts = []
        for r in _check_ranges(ranges, len(self)):
            first, last = int(self.cu_seqlens[r.start]), int(self.cu_seqlens[r.stop])
            tokens = slice(first, last)
            parts.append(
                PackedBatch(
                    input_ids=self.input_ids[tokens],
                    cu_seqlens=self.cu_seqlens[r.start : r.stop + 1] - first,
                    position_ids=self.position_ids[tokens],
                    action_mask=self.action_mask[tokens],
                    scores=self.scores[r.start : r.stop],
                    indices=self.indices[r.start : r.stop],
                    weight_versions=self.weight_versions[r.start : r.stop],
                    fields={name: values[tokens] for name, values in self.fields.items()},
                )
            )
        return parts

    def select(self, seq_indices: Sequence[int]) -> PackedBatch:
        """The given sequences, in the given order (a copy) -- e.g. one planned micro-batch."""
        chosen = torch.as_tensor(list(seq_indices), dtype=torch.long)
        starts = self.cu_seqlens[:-1].long()[chosen]
        lens = self.seq_lens[chosen]
        seq_id, offset = _token_coordinates(lens)
        tokens = starts[seq_id] + offset
        return PackedBatch(
            input_ids=self.input_ids[tokens],
            cu_seqlens=_cu_seqlens(lens),
            position_ids=self.position_ids[tokens],
            action_mask=self.action_mask[tokens],
            scores=self.scores[chosen],
            indices=self.indices[chosen],
            weight_versions=self.weight_versions[chosen],
            fields={name: values[tokens] for name, values in self.fields.items()},
        )

    def clone(self) -> PackedBatch:
        """Own storage for every tensor (pickling a view would ship its whole parent storage)."""
        return _map_tensors(self, lambda t: t.clone())

    def to(self, device: torch.device | str) -> PackedBatch:
        return _map_tensors(self, lambda t: t.to(device))

    # -- sizes
    def __len__(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def sequence_ids(self) -> Tensor:
        """`[N]`, shaped like `action_mask`: each token's sequence, 0..B-1 (from `cu_seqlens`).

        What a per-sequence reduction over the flat layout needs (`rlhf_orch.algo.losses`)."""
        lens = self.seq_lens.to(self.input_ids.device)
        return torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)

    @property
    def seq_lens(self) -> Tensor:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()

    @property
    def response_lens(self) -> Tensor:
        seq_id, _ = _token_coordinates(self.seq_lens)
        return torch.bincount(seq_id[self.action_mask.bool()], minlength=len(self))

    @property
    def max_seqlen(self) -> int:
        """Longest sequence (what varlen attention kernels ask for next to cu_seqlens)."""
        return int(self.seq_lens.max()) if len(self) else 0

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def nbytes(self) -> int:
        return _tensors_nbytes(_all_tensors(self))


# --------------------------------------------------------------------------- wire format
def _to_wire(t: Tensor):
    # CPU tensors travel as numpy arrays: pickle protocol 5 ships their bytes out of band, so Ray
    # copies them straight into (and maps them straight out of) the object store, and a view
    # ships only its own bytes. Plain torch pickling goes through a byte stream at a fraction of
    # memcpy speed.
    return t.numpy() if t.device.type == "cpu" else t


def _from_wire(a) -> Tensor:
    import warnings

    if isinstance(a, Tensor):
        return a
    with warnings.catch_warnings():
        # Arrays mapped from Ray's object store are read-only; nothing writes into experience
        # tensors in place (every step makes new tensors), so they are used without a copy.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _rebuild_batch(cls, tensors: dict, fields: dict):
    return cls(**{k: _from_wire(v) for k, v in tensors.items()}, fields={k: _from_wire(v) for k, v in fields.items()})


def _reduce_batch(batch):
    tensors = {f.name: _to_wire(getattr(batch, f.name)) for f in dataclass_fields(batch) if f.name != "fields"}
    return _rebuild_batch, (type(batch), tensors, {k: _to_wire(v) for k, v in batch.fields.items()})


PaddedBatch.__reduce__ = _reduce_batch  # type: ignore[method-assign]
PackedBatch.__reduce__ = _reduce_batch  # type: ignore[method-assign]


# --------------------------------------------------------------------------- layout-independent
def _scatter_response_values(
    action_mask: Tensor,
    per_sample: Sequence[Tensor | list[float]],
    response_lens: Tensor,
    action_positions: Tensor | None = None,
) -> Tensor:
    """A field tensor shaped like `action_mask`, holding `per_sample[b]` at row b's actions.

    Flattening `action_mask` row-major (padded) or in order (packed) visits the action positions
    sample by sample and, within a sample, in time order -- in both layouts. `action_positions`
    (`action_mask.flatten().nonzero()`) may be passed in when several fields are scattered: a
    long index computed once is ~2.5x faster per field than a boolean mask each time.
    """
    values = [_as_floats(v) for v in per_sample]
    got = [len(v) for v in values]
    want = response_lens.tolist()
    if got != want:
        raise ValueError(f"per-sample value counts {got} do not match response lengths {want}")
    if action_positions is None:
        action_positions = action_mask.bool().flatten().nonzero().squeeze(1)
    out = torch.zeros(action_mask.numel(), dtype=torch.float32)
    out[action_positions] = torch.cat(values) if values else torch.zeros(0)
    return out.view(action_mask.shape)


def _response_values_per_sample(
    action_mask: Tensor, fields: dict[str, Tensor], response_lens: Tensor
) -> list[dict[str, Tensor]]:
    split_sizes = response_lens.tolist()
    keep = action_mask.bool()
    per_field = {name: torch.split(values[keep], split_sizes) for name, values in fields.items()}
    return [{name: chunks[b] for name, chunks in per_field.items()} for b in range(len(split_sizes))]


def _all_tensors(batch: PaddedBatch | PackedBatch) -> list[Tensor]:
    tensors = [getattr(batch, f.name) for f in dataclass_fields(batch) if f.name != "fields"]
    return tensors + list(batch.fields.values())


def _map_tensors(batch: BatchT, fn: Callable[[Tensor], Tensor]) -> BatchT:
    kwargs = {f.name: getattr(batch, f.name) for f in dataclass_fields(batch)}
    mapped = {name: fn(value) for name, value in kwargs.items() if name != "fields"}
    mapped["fields"] = {name: fn(values) for name, values in batch.fields.items()}
    return type(batch)(**mapped)
