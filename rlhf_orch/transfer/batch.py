"""Experience formats: what one generated sequence is, and the two batch layouts trainers consume.

`Sample`       one generated sequence, as an engine returns it (plus its reward).
`PaddedBatch`  `[B, L]` rows, right padded -- what a plain HF forward takes.
`PackedBatch`  every sequence concatenated into `[N]` with `cu_seqlens` -- padding-free, what a
               varlen (flash-attention style) forward takes, and the cheap thing to move around.
Micro-batch planners (pure functions on lengths/counts) live at the bottom.

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

import heapq
import sys
from dataclasses import dataclass, field, fields as dataclass_fields
from typing import Callable, Iterable, Sequence, TypeVar

import numpy as np
import torch
from torch import Tensor

ENGINE_LOGPROBS = "engine_logprobs"  # field name under which Sample.engine_logprobs travel
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
    def from_samples(
        cls, samples: Sequence[Sample], pad_id: int, pad_to: int | None = None
    ) -> PaddedBatch:
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


# --------------------------------------------------------------------------- packed while generating
_TOKEN_DTYPES = {"input_ids": np.int64, "position_ids": np.int64, "action_mask": np.bool_}
_ROW_DTYPES = {
    "start": np.int64, "seq_len": np.int64, "prompt_len": np.int64, "score": np.float32,
    "index": np.int64, "weight_version": np.int64, "truncated": np.bool_,
}
_ALIGN = 64  # bytes: every tensor of a cut starts on a cache line


def _np_values(values: list | Tensor | np.ndarray, dtype) -> np.ndarray:
    """1-D numpy values without a copy where possible (assigning into a buffer casts)."""
    if isinstance(values, Tensor):
        return values.detach().reshape(-1).cpu().numpy()
    return np.asarray(values, dtype=dtype).reshape(-1)


def _grown(buffer: np.ndarray, used: int, capacity: int) -> np.ndarray:
    out = np.empty(capacity, dtype=buffer.dtype)
    out[:used] = buffer[:used]
    return out


class PackedBuffer:
    """The packed layout, built one sequence at a time and cut into pieces without per-sample work.

    An engine appends each sequence as it finishes (`append`): its tokens, positions, action mask
    and every per-token field go straight into flat per-token buffers in the packed layout, and
    its scalars (index, reward, weight version, truncated, where it starts) into per-sequence
    buffers. Buffers grow geometrically and keep their capacity across `clear`, so a steady run
    allocates nothing. Sequences stay addressable by sample index (`row_of`; appending an index
    again replaces it). `cut` lays out several pieces (row lists) in one pass per per-token
    buffer: one contiguous copy per run of rows that are adjacent here, into an output buffer that
    is reused while nothing else refers to it. Each piece's tensors are views of that buffer --
    valid until the next `cut` or `reserve_cut` of this buffer (Ray copies a returned piece into
    the object store when the engine's method returns; an in-process caller that keeps a piece
    makes the next cut allocate a fresh output buffer).
    """

    def __init__(self, tokens: int = 0, rows: int = 0):
        self._tokens = 0  # per-token positions written (replaced rows included)
        self._rows = 0  # rows written
        self._token_cap = max(tokens, 1024)
        self._row_cap = max(rows, 64)
        self._tok = {name: np.empty(self._token_cap, dtype) for name, dtype in _TOKEN_DTYPES.items()}
        self._row = {name: np.empty(self._row_cap, dtype) for name, dtype in _ROW_DTYPES.items()}
        self._field_names: tuple[str, ...] | None = None  # per-token float fields, fixed by the first row
        self.row_of: dict[int, int] = {}  # sample index -> row
        self._arange = np.arange(8192, dtype=np.int64)
        self._out = np.empty(0, np.uint8)  # cut output (see the class docstring)

    # -- sizes
    def __len__(self) -> int:
        return len(self.row_of)

    @property
    def field_names(self) -> tuple[str, ...]:
        return self._field_names or ()

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequences held (replaced rows excluded)."""
        rows = np.fromiter(self.row_of.values(), np.int64, len(self.row_of))
        return int(self._row["seq_len"][rows].sum())

    def reserve(self, tokens: int, rows: int) -> None:
        """Room for `tokens` more tokens in `rows` more sequences without growing mid-generation."""
        self._ensure(self._tokens + tokens, self._rows + rows)

    def _ensure(self, tokens: int, rows: int) -> None:
        if tokens > self._token_cap:
            self._token_cap = max(tokens, 2 * self._token_cap)
            self._tok = {name: _grown(b, self._tokens, self._token_cap) for name, b in self._tok.items()}
        if rows > self._row_cap:
            self._row_cap = max(rows, 2 * self._row_cap)
            self._row = {name: _grown(b, self._rows, self._row_cap) for name, b in self._row.items()}

    def clear(self) -> None:
        """Release every sequence (the capacity stays)."""
        self._tokens = self._rows = 0
        self._field_names = None
        self.row_of = {}

    # -- filling
    def append(
        self,
        prompt_ids: list[int] | Tensor,
        response_ids: list[int] | Tensor,
        engine_logprobs: list[float] | Tensor | None,
        fields: dict[str, list[float] | Tensor],
        *,
        index: int,
        weight_version: int = 0,
        truncated: bool = False,
        reward: float = float("nan"),
    ) -> int:
        """Write one sequence in the packed layout; returns its row."""
        prompt, response = _np_values(prompt_ids, np.int64), _np_values(response_ids, np.int64)
        p, r = len(prompt), len(response)
        n = p + r
        if p == 0:
            raise ValueError(
                f"sample index={index} has an empty prompt; the first response token "
                "must be predicted from at least one prompt token"
            )
        values = {} if engine_logprobs is None else {ENGINE_LOGPROBS: engine_logprobs}
        values.update(sorted(fields.items()))
        names = tuple(values)
        if self._field_names is None:
            self._field_names = names
            for name in names:
                self._tok.setdefault(name, np.empty(self._token_cap, np.float32))
        elif names != self._field_names:
            raise ValueError(
                f"sample index={index} carries fields {sorted(names)}, the sequences held "
                f"{sorted(self._field_names)}; every sample of a batch must carry the same fields "
                f"({ENGINE_LOGPROBS}: all samples or none)"
            )
        arrays = {name: _np_values(v, np.float32) for name, v in values.items()}
        for name, a in arrays.items():
            if len(a) != r:
                raise ValueError(f"sample index={index}: {name} has {len(a)} values for {r} response tokens")
        self._ensure(self._tokens + n, self._rows + 1)
        s = self._tokens
        first, last = s + p - 1, s + n - 1  # action positions: first .. last-1
        t = self._tok
        t["input_ids"][s : s + p] = prompt
        t["input_ids"][s + p : s + n] = response
        if n > len(self._arange):
            self._arange = np.arange(max(n, 2 * len(self._arange)), dtype=np.int64)
        t["position_ids"][s : s + n] = self._arange[:n]
        mask = t["action_mask"]
        mask[s:first] = False
        mask[first:last] = True
        mask[last] = False
        for name, a in arrays.items():
            buf = t[name]
            buf[s:first] = 0
            buf[first:last] = a
            buf[last] = 0
        k = self._rows
        row = self._row
        row["start"][k], row["seq_len"][k], row["prompt_len"][k] = s, n, p
        row["score"][k], row["index"][k] = reward, index
        row["weight_version"][k], row["truncated"][k] = weight_version, truncated
        self.row_of[int(index)] = k
        self._tokens += n
        self._rows += 1
        return k

    def set_scores(self, rows: Sequence[int], scores: Sequence[float]) -> None:
        self._row["score"][np.asarray(rows, dtype=np.int64)] = np.asarray(scores, dtype=np.float32)

    def rows(self, indices: Iterable[int]) -> list[int]:
        """Rows of the given sample indices (a clear error for one not held)."""
        try:
            return [self.row_of[i] for i in indices]
        except KeyError as err:
            raise ValueError(f"sample {err.args[0]} is planned but this engine does not hold it") from None

    # -- reading
    def scalars(self, rows: Sequence[int]) -> dict[str, list]:
        """Per row: index, seq_len, prompt_len, score, weight_version, truncated (Python values)."""
        at = np.asarray(rows, dtype=np.int64)
        return {name: self._row[name][at].tolist() for name in _ROW_DTYPES if name != "start"}

    def _cut_nbytes(self, tokens: int, rows: int) -> int:
        itemsizes = [self._tok[name].itemsize for name in (*_TOKEN_DTYPES, *self.field_names)]
        return sum(-(-tokens * size // _ALIGN) * _ALIGN for size in itemsizes)

    def reserve_cut(self) -> None:
        """Size and touch the cut's output buffer for everything held, so the hand-over finds
        it mapped (an engine calls this at the end of generation; page faults cost a pass)."""
        need = self._cut_nbytes(self.num_tokens, len(self))
        if need > self._out.nbytes or sys.getrefcount(self._out) > 2:
            self._out = np.empty(need, np.uint8)
            self._out.fill(0)

    def cut(self, pieces: Sequence[Sequence[int]]) -> list[PackedBatch | None]:
        """One `PackedBatch` per row list (None for an empty one), rows in the given order."""
        counts = [len(rows) for rows in pieces]
        total = sum(counts)
        if not total:
            return [None for _ in pieces]
        order = np.fromiter((k for rows in pieces for k in rows), np.int64, total)
        starts, lens = self._row["start"][order], self._row["seq_len"][order]
        first_row = np.cumsum([0] + counts)  # piece boundaries in rows
        cum_tokens = np.concatenate([[0], np.cumsum(lens)])
        first_token = cum_tokens[first_row]  # piece boundaries in tokens
        tokens = int(cum_tokens[-1])
        # Runs: consecutive rows adjacent here, never crossing a piece boundary.
        new_run = np.ones(total, dtype=bool)
        new_run[1:] = starts[1:] != starts[:-1] + lens[:-1]
        new_run[first_row[:-1][np.asarray(counts) > 0]] = True
        run_rows = np.flatnonzero(new_run)
        run_from = starts[run_rows].tolist()
        run_to = (starts[run_rows] + np.add.reduceat(lens, run_rows)).tolist()
        runs = [slice(a, b) for a, b in zip(run_from, run_to)]

        need = self._cut_nbytes(tokens, total)
        if need > self._out.nbytes or sys.getrefcount(self._out) > 2:
            self._out = np.empty(need, np.uint8)
        flat: dict[str, np.ndarray] = {}
        offset = 0
        for name in (*_TOKEN_DTYPES, *self.field_names):
            src = self._tok[name]
            dst = self._out[offset : offset + tokens * src.itemsize].view(src.dtype)
            np.concatenate([src[run] for run in runs], out=dst)
            flat[name] = dst
            offset += -(-tokens * src.itemsize // _ALIGN) * _ALIGN
        row = self._row
        out: list[PackedBatch | None] = []
        for k, count in enumerate(counts):
            if not count:
                out.append(None)
                continue
            rows = order[first_row[k] : first_row[k + 1]]
            a, b = int(first_token[k]), int(first_token[k + 1])
            cu = np.zeros(count + 1, dtype=np.int32)
            np.cumsum(lens[first_row[k] : first_row[k + 1]], out=cu[1:])
            view = {name: torch.from_numpy(values[a:b]) for name, values in flat.items()}
            out.append(
                PackedBatch(
                    input_ids=view["input_ids"],
                    cu_seqlens=torch.from_numpy(cu),
                    position_ids=view["position_ids"],
                    action_mask=view["action_mask"],
                    scores=torch.from_numpy(row["score"][rows]),
                    indices=torch.from_numpy(row["index"][rows]),
                    weight_versions=torch.from_numpy(row["weight_version"][rows]),
                    fields={name: view[name] for name in self.field_names},
                )
            )
        return out

    def samples(self, rows: Sequence[int]) -> list[Sample]:
        """The given rows as `Sample`s (own storage; what `append` takes back)."""
        t, row = self._tok, self._row
        out = []
        for k in rows:
            s, n, p = int(row["start"][k]), int(row["seq_len"][k]), int(row["prompt_len"][k])
            actions = slice(s + p - 1, s + n - 1)
            per_token = {name: torch.from_numpy(t[name][actions].copy()) for name in self.field_names}
            out.append(
                Sample(
                    prompt_ids=torch.from_numpy(t["input_ids"][s : s + p].copy()),
                    response_ids=torch.from_numpy(t["input_ids"][s + p : s + n].copy()),
                    reward=float(row["score"][k]),
                    engine_logprobs=per_token.pop(ENGINE_LOGPROBS, None),
                    weight_version=int(row["weight_version"][k]),
                    index=int(row["index"][k]),
                    truncated=bool(row["truncated"][k]),
                    fields=per_token,
                )
            )
        return out


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


# --------------------------------------------------------------------------- micro-batch planners
def split_by_count(n_seqs: int, micro_batch_size: int) -> list[range]:
    """Consecutive ranges of `micro_batch_size` sequences; the last one may be shorter."""
    if micro_batch_size < 1:
        raise ValueError(f"algo.micro_batch_size={micro_batch_size} must be >= 1")
    if n_seqs < 0:
        raise ValueError(f"n_seqs={n_seqs} must be >= 0")
    return [range(s, min(s + micro_batch_size, n_seqs)) for s in range(0, n_seqs, micro_batch_size)]


def near_equal_ranges(n: int, parts: int) -> list[range]:
    """`parts` contiguous ranges covering 0..n-1, sizes differing by at most one (larger first)."""
    base, extra = divmod(n, parts)
    ranges, start = [], 0
    for k in range(parts):
        size = base + (1 if k < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def shard_for_ranks(n: int, num_ranks: int) -> list[range]:
    """Contiguous, equal shards of `n` sequences, one per data-parallel rank.

    Contiguous (not strided) so the samples of one prompt stay on one rank and a shard of a
    `PackedBatch` is a view (`PackedBatch.split`). Equal, because data-parallel ranks take the
    same number of optimizer steps over the same number of sequences.
    """
    if num_ranks < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {num_ranks}")
    if n % num_ranks:
        raise ValueError(
            f"{n} sequences per step (algo.rollout_batch_size x algo.samples_per_prompt) do not "
            f"divide evenly over {num_ranks} data-parallel ranks (placement.actor_ranks / "
            "placement.critic_ranks); make the product a multiple of the data-parallel size"
        )
    per_rank = n // num_ranks
    return [range(r * per_rank, (r + 1) * per_rank) for r in range(num_ranks)]


def plan_token_budget_micro_batches(
    lengths: Sequence[int], token_budget: int, num_ranks: int, groups: Sequence[int] | None = None
) -> list[list[list[int]]]:
    """Plan token-budgeted micro-batches: `plan[rank][micro_batch] = [sequence indices]`.

    Guarantees:
    * every index in `range(len(lengths))` appears exactly once in the whole plan;
    * every micro-batch holds at most `token_budget` tokens (sum of its sequences' lengths);
    * every rank gets the SAME number of micro-batches -- DeepSpeed ranks all-reduce gradients in
      lockstep, so a rank with fewer backward passes would hang the others;
    * tokens per rank are balanced.

    Method (deterministic; ties broken by index, then rank id):
    1. Ranks: greedy longest-processing-time -- sequences, longest first, each onto the rank with
       the fewest tokens so far (LPT: within 4/3 of the optimal makespan).
    2. Per rank: first-fit-decreasing bin packing into micro-batches of `token_budget`.
    3. Equalise: a rank with fewer micro-batches than the most has splits its micro-batch with
       the most sequences in two (halves balanced by tokens) until it matches. Only when a rank
       has fewer sequences than the target count does it get EXPLICIT EMPTY micro-batches `[]`
       at the end of its list: the caller must still run a zero-loss forward/backward for them
       (`ppo_math` reductions over no tokens are 0) so the collectives line up.
    Within a micro-batch, indices are ascending.

    `groups` (optional, per sequence: e.g. the engine holding it) keeps micro-batches within one
    group: step 2 packs each group of a rank on its own, then dissolves the lightest micro-batches
    holding at most half the budget into the others' free room (those become mixed) while the
    rank has more micro-batches than its tokens need. A rank thus gets at most one micro-batch
    more per further group than step 2 over the whole rank gives, each over half full (should it
    get more, it is packed as without groups). Micro-batches are listed group by group in turns.
    Step 1 ignores groups, so the balance over ranks is the same either way; a micro-batch within
    one group reaches a trainer as a view of that group's piece (no copy).
    """
    if token_budget < 1:
        raise ValueError(
            f"transfer.token_budget={token_budget} must be >= 1 when planning micro-batches "
            "(0 means 'derive': resolve it to algo.micro_batch_size x max sequence length first)"
        )
    if num_ranks < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {num_ranks}")
    for i, length in enumerate(lengths):
        if length < 1:
            raise ValueError(f"sequence {i} has length {length}; every sequence has >= 1 token")
    too_long = [(i, length) for i, length in enumerate(lengths) if length > token_budget]
    if too_long:
        i, length = max(too_long, key=lambda item: item[1])
        raise ValueError(
            f"{len(too_long)} sequence(s) exceed transfer.token_budget={token_budget}, the longest "
            f"is sequence {i} with {length} tokens; set transfer.token_budget >= {length} (or "
            "shorten data.prompt_max_len + data.response_max_len)"
        )

    longest_first = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    members = _balance_over_ranks(longest_first, lengths, num_ranks)
    if groups is not None and len(groups) != len(lengths):
        raise ValueError(f"{len(groups)} groups for {len(lengths)} sequences")
    per_rank = [
        _first_fit_decreasing(m, lengths, token_budget)
        if groups is None
        else _grouped_or_plain(m, lengths, token_budget, groups)
        for m in members
    ]
    target = max((len(mbs) for mbs in per_rank), default=0)
    return [_equalise(mbs, lengths, target) for mbs in per_rank]


def _balance_over_ranks(order: list[int], lengths: Sequence[int], num_ranks: int) -> list[list[int]]:
    # Heap of (tokens so far, sequences so far, rank): least-loaded rank on top.
    heap = [(0, 0, rank) for rank in range(num_ranks)]
    members: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in order:
        load, count, rank = heapq.heappop(heap)
        members[rank].append(i)
        heapq.heappush(heap, (load + lengths[i], count + 1, rank))
    return members


def _first_fit_decreasing(
    members: list[int], lengths: Sequence[int], budget: int
) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(members, key=lambda i: (-lengths[i], i)):
        length = lengths[i]
        for slot, free in enumerate(room):  # first fit (a plain loop: this is the planner's hot spot)
            if length <= free:
                break
        else:
            bins.append([])
            room.append(budget)
            slot = len(bins) - 1
        bins[slot].append(i)
        room[slot] -= length
    return [sorted(b) for b in bins]


def _grouped_first_fit_decreasing(
    members: list[int], lengths: Sequence[int], budget: int, groups: Sequence[int]
) -> list[list[int]]:
    """First-fit-decreasing per group; then the lightest micro-batches holding at most half the
    budget are dissolved into the others' free room while the rank has more micro-batches than
    its tokens need (see the planner)."""
    by_group: dict[int, list[int]] = {}
    for i in members:
        by_group.setdefault(groups[i], []).append(i)
    # (turn within its group, group, members): listing order, and what each bin holds.
    bins = [
        (turn, group, b)
        for group in sorted(by_group)
        for turn, b in enumerate(_first_fit_decreasing(by_group[group], lengths, budget))
    ]
    loads = [sum(lengths[i] for i in b) for _, _, b in bins]
    fewest = -(-sum(loads) // budget)  # no packing has fewer micro-batches
    while len(bins) > fewest:
        for light in sorted(range(len(bins)), key=lambda b: (loads[b], b)):
            if 2 * loads[light] > budget:
                return _in_turns(bins)  # the rest are over half full: kept apart, one group each
            placed = _best_fit(bins[light][2], {b: budget - loads[b] for b in range(len(bins)) if b != light}, lengths)
            if placed is None:
                continue
            for b, extra in placed.items():
                turn, group, held = bins[b]
                bins[b] = (turn, group, sorted(held + extra))
                loads[b] += sum(lengths[i] for i in extra)
            del bins[light], loads[light]
            break
        else:
            break  # nothing dissolves into the others' room
    return _in_turns(bins)


def _grouped_or_plain(members: list[int], lengths: Sequence[int], budget: int, groups: Sequence[int]) -> list[list[int]]:
    """Grouped micro-batches, unless they outnumber first-fit-decreasing over the whole rank by
    more than one per further group (groups of complementary lengths could): then those."""
    grouped = _grouped_first_fit_decreasing(members, lengths, budget, groups)
    extra = len({groups[i] for i in members}) - 1
    if len(grouped) <= -(-sum(lengths[i] for i in members) // budget) + extra:
        return grouped  # within the bound whatever first-fit-decreasing gives (it gives at least that)
    plain = _first_fit_decreasing(members, lengths, budget)
    return grouped if len(grouped) <= len(plain) + extra else plain


def _best_fit(members: list[int], room: dict[int, int], lengths: Sequence[int]) -> dict[int, list[int]] | None:
    """Longest first, each into the fullest bin it fits (filling one bin first); None if one fits nowhere."""
    placed: dict[int, list[int]] = {}
    room = dict(room)
    for i in sorted(members, key=lambda i: (-lengths[i], i)):
        fits = [b for b, free in room.items() if lengths[i] <= free]
        if not fits:
            return None
        best = min(fits, key=lambda b: (room[b], b))
        room[best] -= lengths[i]
        placed.setdefault(best, []).append(i)
    return placed


def _in_turns(bins: list[tuple[int, int, list[int]]]) -> list[list[int]]:
    """Micro-batches group by group in turns (each group's first, then each group's second, ...)."""
    return [b for _, _, b in sorted(bins, key=lambda t: (t[0], t[1]))]


def _equalise(micro_batches: list[list[int]], lengths: Sequence[int], target: int) -> list[list[int]]:
    result = [list(mb) for mb in micro_batches]
    while len(result) < target:
        splittable = [b for b, mb in enumerate(result) if len(mb) >= 2]
        if not splittable:
            result.append([])  # explicit empty micro-batch, see the planner's docstring
            continue
        b = max(splittable, key=lambda b: (len(result[b]), sum(lengths[i] for i in result[b]), -b))
        result[b:b + 1] = _halve_by_tokens(result[b], lengths)
    return result


def _halve_by_tokens(indices: list[int], lengths: Sequence[int]) -> list[list[int]]:
    halves: list[list[int]] = [[], []]
    loads = [0, 0]
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        lighter = 0 if loads[0] <= loads[1] else 1
        halves[lighter].append(i)
        loads[lighter] += lengths[i]
    return [sorted(h) for h in halves]
