"""One training update of every `algo` option, written plainly: the specification of what the
distributed trainer computes.

No Ray, DeepSpeed, packing, micro-batches or data-parallel ranks: one process, the policy (and
critic) as plain `torch.nn.Module`s run on a right-padded batch, the rollout as Python lists, loops
over sequences where a loop is the clearest way to say it (CleanRL's style; the papers' names).
It shares no code with `advantages`, `losses` or the trainer -- only `AlgoConfig`'s field names
and the estimator classes' names (`ADVANTAGES`) -- so a test holding the
trainer's result equal to this one checks the combination of strategies (transfer layout,
micro-batch cut, ranks, epochs) against the algorithm, not the code against itself
(`tests/algo/test_oracle_matrix.py`).

What one update is, for a rollout of N sequences (prompt x_i, response y_i, score r_i, group g_i):

1. pi_old: log-probs of every response token under the policy before the update (at the sampling
   temperature: the run's, or the token's own where it was sampled at another -- an agent's call
   with its own settings). KL estimates compare them with the reference's log-probs (given).
2. Advantages A_it (and, for PPO, returns R_it), per `algo`:
     PPO          GAE over token rewards (-kl_coef * KL_t, + r_i at the last token) with the
                  critic's values V_old, R = A + V_old; A whitened over all tokens of the rollout.
                  Per-turn rewards u_it (env.reward=per_turn; each turn's on its last token):
                  + u_it at token t, and r_i - sum_t u_it (not r_i) at the last token
     GRPO         (r_i - mean_g) / (std_g + eps), std unbiased; Dr. GRPO: r_i - mean_g
     RLOO         r_i - mean of the other samples of the group
     REINFORCE++  return-to-go of the token rewards (gamma; per-turn rewards as PPO's),
                  whitened over all tokens; -baseline: r_i - mean_g first
     DAPO         GRPO on r_i + overlong penalty
     on-policy    0 (the reward is not trained on): only the teacher's term below
     distillation
   Every algorithm with a teacher term (distill_coef > 0) then adds, per action token,
       distill_coef * (log pi_teacher(y_t) - log pi_old(y_t))
   to its advantage (after PPO's and REINFORCE++'s whitening; the returns are untouched).
   A group of one, or of equal scores, gets advantage 0 (docs/algorithms.md compares with veRL) --
   unless per-turn rewards give its tokens different returns-to-go (REINFORCE++-baseline: G_it - mean_g).
3. For each optimizer step (its sequences are given: which sequences share a step is the
   trainer's sampling decision, `policy_steps`), the loss over the step's sequences S
       l_it = max(-A ratio, -A clip(ratio, 1 - clip_low, 1 + clip_high))   ratio = pi / pi_old
       l_it = min(l_it, -A clip_ratio_c)            where A < 0 (dual clip, when set)
       l_it = l_it * w_it                                      (an importance weight, below)
            + kl_coef * KL(pi, pi_ref)_t                       (kl_placement=in_loss)
            - entropy_coef * H_t
   with w_it = min(pi_old / pi_engine, tis_cap) (TIS, when set); or pi_old / pi_engine where that
   is <= decoupled_is_cap and 0 where it is above, the token dropped (AReaL's decoupled PPO, when
   set: pi_old is the proximal policy the clip is against); else 1. Aggregated as `loss_agg`
   (n_i: action tokens of i; |S|: sequences with n_i > 0):
       token-mean               sum_i sum_t l_it / sum_i n_i
       seq-mean-token-sum       sum_i sum_t l_it / |S|
       seq-mean-token-mean      sum_i (sum_t l_it / n_i) / |S|
       seq-mean-token-sum-norm  sum_i sum_t l_it / (|S| * norm_len)
   then the gradient's norm is clipped to `grad_clip` and the optimizer steps.
4. The critic (PPO): per step (`critic_steps`), 0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2),
   a token mean over the step's tokens.

Metrics use the names the run logs (`rlhf_orch.trainer.metrics`): per step, then averaged over the
steps; gradient norms are the largest pre-clipping norm of any step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

from rlhf_orch.algo.ppo_math import LOGPROB_DIFF_THRESHOLD, WHITEN_EPS


@dataclass
class Rollout:
    """A fixed rollout, one entry per sequence. Per-token lists are over the response tokens."""

    prompts: list[list[int]]
    responses: list[list[int]]
    scores: list[float]
    group_ids: list[int]
    ref_logprobs: list[list[float]] | None = None  # the reference policy's (KL terms)
    teacher_logprobs: list[list[float]] | None = None  # the teacher's (distill_coef)
    engine_logprobs: list[list[float]] | None = None  # the behaviour policy's (TIS, decoupled PPO)
    loss_masks: list[list[int]] | None = None  # 1 = trained on; 0 = a hole (e.g. a tool's output)
    # env.reward=per_turn: per response token, a turn's reward on its last token (PPO, REINFORCE++)
    turn_rewards: list[list[float]] | None = None
    # per response token, the temperature it was sampled at; 0: the run's (Optimization.temperature)
    temperatures: list[list[float]] | None = None

    def temperatures_of(self, i: int, run: float) -> list[float]:
        own = self.temperatures[i] if self.temperatures else [0.0] * len(self.responses[i])
        return [t if t > 0 else run for t in own]

    def mask(self, i: int) -> list[bool]:
        return [bool(m) for m in self.loss_masks[i]] if self.loss_masks else [True] * len(self.responses[i])


@dataclass
class Optimization:
    """How the weights move: what `trainer.*` and `algo.*_lr` / `grad_clip` say."""

    actor_lr: float
    optimizer: str  # "adamw" (betas 0.9, 0.95) or "sgd"
    weight_decay: float
    grad_clip: float  # 0 = off
    temperature: float
    critic_lr: float = 0.0
    norm_len: int = 0  # seq-mean-token-sum-norm's constant (algo.loss_agg_norm_len or response_max_len)


@dataclass
class OracleResult:
    policy: nn.Module
    critic: nn.Module | None
    metrics: dict[str, float]
    # Per sequence, per response token: pi_old and the advantage it trains with (what the rollout
    # dump shows of every sequence it dumps).
    old_logprobs: list[Tensor] = field(default_factory=list)
    advantages: list[Tensor] = field(default_factory=list)


# --------------------------------------------------------------------------- per sequence
def _right_padded(prompts: list[list[int]], responses: list[list[int]]) -> tuple[Tensor, Tensor]:
    """Token ids `[B, L]` right padded with 0, and the attention mask (a plain HF batch)."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    return ids, mask


def response_logprobs(
    policy: nn.Module, prompts: list[list[int]], responses: list[list[int]], temperatures: list[list[float]]
) -> tuple[list[Tensor], list[Tensor]]:
    """Per sequence, log pi(y_t | x, y_<t) and the entropy of that next-token distribution, for
    every response token, at the temperature y_t was sampled at (one batched forward; padding sits
    after each sequence, so it changes nothing a causal model computes for the real tokens)."""
    ids, attention = _right_padded(prompts, responses)
    logits = policy(input_ids=ids, attention_mask=attention).logits.float()
    logps, entropies = [], []
    for b, (x, y) in enumerate(zip(prompts, responses)):
        # the positions that predict y_0 .. y_T-1, each divided by its token's temperature
        step_logits = logits[b, len(x) - 1 : len(x) - 1 + len(y)] / torch.tensor(temperatures[b])[:, None]
        log_probs = torch.log_softmax(step_logits, dim=-1)
        logps.append(log_probs.gather(-1, torch.tensor(y, dtype=torch.long)[:, None]).squeeze(-1))
        entropies.append(-(log_probs.exp() * log_probs).sum(-1))
    return logps, entropies


def response_values(critic: nn.Module, prompts: list[list[int]], responses: list[list[int]]) -> list[Tensor]:
    """Per sequence, V of the state each response token is chosen in (after x, y_<t)."""
    ids, attention = _right_padded(prompts, responses)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    values = critic(input_ids=ids, attention_mask=attention, position_ids=positions).float()
    return [values[b, len(x) - 1 : len(x) - 1 + len(y)] for b, (x, y) in enumerate(zip(prompts, responses))]


def kl_estimate(logp: Tensor, ref: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) (Schulman's k1, k2, k3; veRL's clamps on k3)."""
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2
    d = torch.clamp(ref - logp, -20.0, 20.0)  # k3 / low_var_kl
    return torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)


# --------------------------------------------------------------------------- advantages
def _groups(group_ids: list[int]) -> dict[int, list[int]]:
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    return members


def _group_centred(scores: list[float], group_ids: list[int], by_std: bool = False, eps: float = 0.0) -> list[float]:
    out = [0.0] * len(scores)
    for members in _groups(group_ids).values():
        rs = [scores[i] for i in members]
        if len(members) < 2 or max(rs) == min(rs):
            continue  # no baseline to compare with, or nothing to learn: 0
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (len(rs) - 1))
        for i in members:
            out[i] = (scores[i] - mean) / (std + eps) if by_std else scores[i] - mean
    return out


def _leave_one_out(scores: list[float], group_ids: list[int]) -> list[float]:
    out = [0.0] * len(scores)
    for members in _groups(group_ids).values():
        k = len(members)
        if k < 2:
            continue
        total = sum(scores[i] for i in members)
        for i in members:
            out[i] = scores[i] - (total - scores[i]) / (k - 1)
    return out


def _token_rewards(score: float, kl: Tensor, mask: list[bool], kl_coef: float, placed: list[float] | None) -> Tensor:
    rewards = -kl_coef * kl
    real = [t for t, m in enumerate(mask) if m]
    for t in real if placed else ():
        rewards[t] += placed[t]
        score -= placed[t]
    if real:
        rewards[real[-1]] += score
    return rewards


def _gae(rewards: Tensor, values: Tensor, mask: list[bool], gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """GAE along the real tokens of one sequence (holes are skipped); after the last one V = 0."""
    adv = torch.zeros_like(rewards)
    next_value, next_adv = 0.0, 0.0
    for t in reversed([t for t, m in enumerate(mask) if m]):
        delta = rewards[t] + gamma * next_value - values[t]
        next_adv = delta + gamma * lam * next_adv
        adv[t] = next_adv
        next_value = values[t]
    real = torch.tensor(mask, dtype=torch.bool)
    return adv, torch.where(real, adv + values, torch.zeros_like(adv))


def _whiten(per_seq: list[Tensor], masks: list[list[bool]], eps: float = WHITEN_EPS) -> list[Tensor]:
    """(x - mean) / sqrt(var + eps) over every real token of the rollout (unbiased var)."""
    real = torch.cat([x[torch.tensor(m, dtype=torch.bool)] for x, m in zip(per_seq, masks)]).double()
    mean = real.mean()
    var = real.var(unbiased=True) if real.numel() > 1 else real.var(unbiased=False)
    return [
        torch.where(torch.tensor(m, dtype=torch.bool), ((x.double() - mean) / torch.sqrt(var + eps)).float(), 0.0)
        for x, m in zip(per_seq, masks)
    ]


def _overlong_penalty(length: int, max_len: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment: a ramp to -penalty over the last `buffer` tokens (0: off)."""
    if buffer == 0:
        return 0.0
    return -penalty * min(max((length - (max_len - buffer)) / buffer, 0.0), 1.0)


@dataclass
class _Inputs:
    """What an advantage specification reads."""

    algo: Any
    rollout: Rollout
    old: list[Tensor]  # pi_old log-probs per sequence
    values: list[Tensor] | None  # V_old per sequence (PPO)
    masks: list[list[bool]]
    max_response_len: int

    def token_rewards(self, scores: list[float]) -> list[Tensor]:
        """r_i at each sequence's last real token, minus kl_coef * KL_t (kl_placement=in_reward);
        with per-turn rewards u_it, u_it at token t and r_i - sum_t u_it at the last one."""
        a = self.algo
        coef = a.kl_coef if (a.kl_placement == "in_reward" and a.kl_coef > 0) else 0.0
        out = []
        for i, score in enumerate(scores):
            kl = (
                kl_estimate(self.old[i], torch.tensor(self.rollout.ref_logprobs[i]), a.kl_estimator)
                if coef
                else torch.zeros_like(self.old[i])
            )
            placed = self.rollout.turn_rewards[i] if self.rollout.turn_rewards else None
            out.append(_token_rewards(score, kl, self.masks[i], coef, placed))
        return out

    def per_token(self, per_sample: list[float]) -> list[Tensor]:
        return [torch.tensor([a if m else 0.0 for m in self.masks[i]]) for i, a in enumerate(per_sample)]


def _ppo(x: _Inputs) -> tuple[list[Tensor], list[Tensor] | None]:
    rewards = x.token_rewards(list(x.rollout.scores))
    adv, ret = zip(*(_gae(rewards[i], x.values[i], x.masks[i], x.algo.gamma, x.algo.lam) for i in range(len(rewards))))
    return (_whiten(list(adv), x.masks) if x.algo.whiten_advantages else list(adv)), list(ret)


def _reinforce_pp(x: _Inputs) -> tuple[list[Tensor], None]:
    scores = list(x.rollout.scores)
    if x.algo.group_baseline:
        scores = _group_centred(scores, x.rollout.group_ids)
    rewards = x.token_rewards(scores)
    returns = [_gae(r, torch.zeros_like(r), m, x.algo.gamma, 1.0)[0] for r, m in zip(rewards, x.masks)]
    return _whiten(returns, x.masks), None


def _grpo(x: _Inputs) -> tuple[list[Tensor], None]:
    return x.per_token(
        _group_centred(list(x.rollout.scores), x.rollout.group_ids, x.algo.norm_by_std, x.algo.eps)
    ), None


def _rloo(x: _Inputs) -> tuple[list[Tensor], None]:
    return x.per_token(_leave_one_out(list(x.rollout.scores), x.rollout.group_ids)), None


def _dapo(x: _Inputs) -> tuple[list[Tensor], None]:
    a, r = x.algo, x.rollout
    # the policy's own tokens: a multi-turn response's observations (holes) do not count
    scores = [
        s + _overlong_penalty(sum(r.mask(i)), x.max_response_len, a.overlong_buffer, a.overlong_penalty)
        for i, s in enumerate(r.scores)
    ]
    return x.per_token(_group_centred(scores, r.group_ids, a.norm_by_std, a.eps)), None


def _on_policy_distill(x: _Inputs) -> tuple[list[Tensor], None]:
    return x.per_token([0.0] * len(x.old)), None


# Per `algo` option's class (rlhf_orch.algo.estimators), its specification.
ADVANTAGES: dict[str, Callable[[_Inputs], tuple[list[Tensor], list[Tensor] | None]]] = {
    "PPO": _ppo,
    "ReinforcePP": _reinforce_pp,  # reinforce_pp and reinforce_pp_baseline (group_baseline)
    "GRPO": _grpo,  # grpo and dr_grpo (norm_by_std=false)
    "RLOO": _rloo,
    "DAPO": _dapo,
    "OnPolicyDistill": _on_policy_distill,
}


def advantages(
    algo: Any, rollout: Rollout, old: list[Tensor], values: list[Tensor] | None, max_response_len: int
) -> tuple[list[Tensor], list[Tensor] | None]:
    """Per-token advantages (and PPO's returns) of every sequence, as the module docstring says."""
    kind = type(algo).__name__
    if kind not in ADVANTAGES:
        raise ValueError(f"the oracle has no specification for algo class {kind}; add one to ADVANTAGES")
    masks = [rollout.mask(i) for i in range(len(old))]
    adv, returns = ADVANTAGES[kind](_Inputs(algo, rollout, old, values, masks, max_response_len))
    coef = algo.distill_coef
    if coef > 0:
        adv = [
            torch.tensor(
                [
                    float(a) + coef * (teacher - float(o)) if m else float(a)
                    for a, o, teacher, m in zip(adv[i], old[i], rollout.teacher_logprobs[i], masks[i])
                ]
            )
            for i in range(len(old))
        ]
    return adv, returns


# --------------------------------------------------------------------------- the update
def _optimizer(params, lr: float, o: Optimization) -> torch.optim.Optimizer:
    if o.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=o.weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=o.weight_decay, betas=(0.9, 0.95))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, loss: Tensor, grad_clip: float) -> float:
    optimizer.zero_grad()
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])))
    if grad_clip > 0 and norm > grad_clip:
        for p in params:
            p.grad.mul_(grad_clip / (norm + 1e-6))
    optimizer.step()
    return norm


def _aggregate(losses: list[Tensor], masks: list[list[bool]], mode: str, norm_len: int) -> Tensor:
    sums, means, tokens, sequences = [], [], 0, 0
    for loss, mask in zip(losses, masks):
        real = torch.tensor(mask, dtype=torch.bool)
        n = int(real.sum())
        if n == 0:
            continue
        total = loss[real].sum()
        sums.append(total)
        means.append(total / n)
        tokens += n
        sequences += 1
    if not sums:
        return torch.zeros(())
    if mode == "token-mean":
        return sum(sums) / tokens
    if mode == "seq-mean-token-sum":
        return sum(sums) / sequences
    if mode == "seq-mean-token-mean":
        return sum(means) / sequences
    if mode == "seq-mean-token-sum-norm":
        return sum(sums) / (sequences * norm_len)
    raise ValueError(f"unknown loss aggregation {mode!r}")


def _token_mean(per_seq: list[Tensor], masks: list[list[bool]]) -> float:
    real = [x[torch.tensor(m, dtype=torch.bool)] for x, m in zip(per_seq, masks)]
    flat = torch.cat(real) if real else torch.zeros(0)
    return float(flat.float().mean()) if flat.numel() else 0.0


def reference_update(
    algo: Any,
    rollout: Rollout,
    policy: nn.Module,
    opt: Optimization,
    policy_steps: list[list[int]],
    critic: nn.Module | None = None,
    critic_steps: list[list[int]] | None = None,
    *,
    value_clip_eps: float,
    max_response_len: int = 0,
) -> OracleResult:
    """One update of `policy` (and `critic`) on `rollout`, in place; see the module docstring.

    `policy_steps` / `critic_steps`: the sequences (indices into the rollout) of each optimizer
    step, in order, over all epochs (no `critic_steps`: the critic only gives V_old).
    """
    n = len(rollout.responses)
    masks = [rollout.mask(i) for i in range(n)]
    temperatures = [rollout.temperatures_of(i, opt.temperature) for i in range(n)]
    with torch.no_grad():
        old, _ = response_logprobs(policy, rollout.prompts, rollout.responses, temperatures)
        values = response_values(critic, rollout.prompts, rollout.responses) if critic is not None else None
    adv, returns = advantages(algo, rollout, old, values, max_response_len)
    metrics: dict[str, float] = {
        "advantages/abs_max": max((float(a.abs().max()) for a in adv if a.numel()), default=0.0)
    }
    # The behaviour policy's log-probs against the recomputed ones (train/inference mismatch).
    diffs = [
        (old[i] - torch.tensor(rollout.engine_logprobs[i]))[torch.tensor(masks[i], dtype=torch.bool)].abs()
        for i in range(n)
        if rollout.engine_logprobs is not None and any(masks[i])
    ]
    every = torch.cat(diffs) if diffs else torch.zeros(0)
    metrics["rollout/logprob_diff_max"] = float(every.max()) if diffs else 0.0
    metrics["rollout/logprob_diff_mean"] = float(every.mean()) if every.numel() else 0.0
    metrics["rollout/logprob_diff_over_frac"] = (
        float((every > LOGPROB_DIFF_THRESHOLD).float().mean()) if every.numel() else 0.0
    )
    if algo.kl_placement != "off" and algo.kl_coef > 0:  # a KL term: the run has a reference
        metrics["kl"] = _token_mean([old[i] - torch.tensor(rollout.ref_logprobs[i]) for i in range(n)], masks)
    if algo.distill_coef > 0:  # the per-token reverse KL to the teacher (k1)
        metrics["distill/reverse_kl"] = _token_mean(
            [old[i] - torch.tensor(rollout.teacher_logprobs[i]) for i in range(n)], masks
        )

    # ---- the policy
    optimizer = _optimizer(policy.parameters(), opt.actor_lr, opt)
    kl_in_loss = algo.kl_placement == "in_loss" and algo.kl_coef > 0
    per_step: dict[str, list[float]] = {}
    norms = []
    for members in policy_steps:
        token_losses, stats = (
            [],
            {
                k: []
                for k in (
                    "clipfrac",
                    "approx_kl",
                    "clipfrac_dual",
                    "tis_weight",
                    "tis_capped",
                    "decoupled_weight",
                    "decoupled_dropped",
                    "kl_loss",
                    "entropy",
                )
            },
        )
        logps, entropies = response_logprobs(
            policy,
            [rollout.prompts[i] for i in members],
            [rollout.responses[i] for i in members],
            [temperatures[i] for i in members],
        )
        for i, logp, entropy in zip(members, logps, entropies):
            a = adv[i]
            log_ratio = torch.clamp(logp - old[i], -20.0, 20.0)
            ratio = torch.exp(log_ratio)
            surrogate = -a * ratio
            clipped = -a * torch.clamp(ratio, 1 - algo.clip_low, 1 + algo.clip_high)
            loss = torch.maximum(surrogate, clipped)
            stats["clipfrac"].append((clipped > surrogate).float())
            stats["approx_kl"].append(((ratio - 1) - log_ratio).detach())
            if algo.clip_ratio_c is not None:
                bound = -a * algo.clip_ratio_c
                stats["clipfrac_dual"].append(((a < 0) & (loss > bound)).float())
                loss = torch.where(a < 0, torch.minimum(loss, bound), loss)
            if algo.tis_cap is not None:
                weight = torch.exp(
                    torch.clamp(old[i] - torch.tensor(rollout.engine_logprobs[i]), max=math.log(algo.tis_cap))
                )
                stats["tis_weight"].append(weight)
                stats["tis_capped"].append((weight >= algo.tis_cap * (1 - 1e-6)).float())
                loss = loss * weight
            if algo.decoupled_is_cap is not None:
                # The engine sampled from a stale policy; the weight moves the expectation to pi_old's
                # samples, and a token that pi_old finds more than decoupled_is_cap times likelier is
                # left out of the loss altogether (float64: exp of any realistic log-ratio is finite).
                weight = torch.exp(old[i].double() - torch.tensor(rollout.engine_logprobs[i], dtype=torch.float64))
                dropped = weight > algo.decoupled_is_cap
                weight = torch.where(dropped, 0.0, weight).float()
                stats["decoupled_weight"].append(weight)
                stats["decoupled_dropped"].append(dropped.float())
                loss = loss * weight
            if kl_in_loss:
                kl = kl_estimate(logp, torch.tensor(rollout.ref_logprobs[i]), algo.kl_estimator)
                stats["kl_loss"].append(kl.detach())
                loss = loss + algo.kl_coef * kl
            if algo.entropy_coef > 0:
                stats["entropy"].append(entropy.detach())
                loss = loss - algo.entropy_coef * entropy
            token_losses.append(loss)
        step_masks = [masks[i] for i in members]
        loss = _aggregate(token_losses, step_masks, algo.loss_agg, opt.norm_len)
        norms.append(_step(policy, optimizer, loss, opt.grad_clip))
        per_step.setdefault("loss/policy", []).append(float(loss))
        for key, name in _POLICY_METRICS.items():
            if stats[key]:
                per_step.setdefault(name, []).append(_token_mean(stats[key], step_masks))
    metrics.update({k: sum(v) / len(v) for k, v in per_step.items()})
    metrics["policy/grad_norm"] = max(norms)

    # ---- the critic
    if critic is not None and critic_steps:
        metrics["values/mean"] = _token_mean(values, masks)
        optimizer = _optimizer(critic.parameters(), opt.critic_lr, opt)
        losses, clipfracs, norms = [], [], []
        for members in critic_steps:
            token_losses, clipped_flags = [], []
            step_values = response_values(
                critic, [rollout.prompts[i] for i in members], [rollout.responses[i] for i in members]
            )
            for i, v in zip(members, step_values):
                v_clipped = torch.clamp(v, values[i] - value_clip_eps, values[i] + value_clip_eps)
                unclipped_sq, clipped_sq = (v - returns[i]) ** 2, (v_clipped - returns[i]) ** 2
                token_losses.append(0.5 * torch.maximum(unclipped_sq, clipped_sq))
                clipped_flags.append((clipped_sq > unclipped_sq).float())
            step_masks = [masks[i] for i in members]
            loss = _aggregate(token_losses, step_masks, "token-mean", 0)
            norms.append(_step(critic, optimizer, loss, opt.grad_clip))
            losses.append(float(loss))
            clipfracs.append(_token_mean(clipped_flags, step_masks))
        metrics["loss/value"] = sum(losses) / len(losses)
        metrics["critic/vf_clipfrac"] = sum(clipfracs) / len(clipfracs)
        metrics["critic/grad_norm"] = max(norms)
    return OracleResult(policy, critic, metrics, old_logprobs=list(old), advantages=list(adv))


_POLICY_METRICS = {
    "clipfrac": "policy/clipfrac",
    "approx_kl": "policy/approx_kl",
    "clipfrac_dual": "policy/clipfrac_dual",
    "tis_weight": "policy/tis_weight",
    "tis_capped": "policy/tis_capped_frac",
    "decoupled_weight": "policy/decoupled_weight",
    "decoupled_dropped": "policy/decoupled_dropped_frac",
    "kl_loss": "loss/kl",
    "entropy": "policy/entropy",
}

__all__ = ["Optimization", "OracleResult", "Rollout", "advantages", "reference_update", "response_logprobs"]
