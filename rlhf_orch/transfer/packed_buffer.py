"""The packed layout built on an engine one finished sequence at a time (`PackedBuffer`), and cut
into one piece per data-parallel rank without per-sample work. Layout and alignment of fields as
in rlhf_orch.transfer.batch (`PackedBatch`).
"""

from __future__ import annotations

import sys
from typing import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from rlhf_orch.transfer.batch import ENGINE_LOGPROBS, PackedBatch, Sample


_TOKEN_DTYPES = {"input_ids": np.int64, "position_ids": np.int64, "action_mask": np.bool_}
_ROW_DTYPES = {
    "start": np.int64,
    "seq_len": np.int64,
    "prompt_len": np.int64,
    "score": np.float32,
    "index": np.int64,
    "weight_version": np.int64,
    "truncated": np.bool_,
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
        weight_version: int = Sample.weight_version,
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
