"""The workload the plan optimises for: which prompts, how much decoding, how well drafts land, which experts.

    prompts:                  # prompt lengths (tokens, with the reused prefix) and their share of requests
      - {tokens: 512, weight: 1}
      - {tokens: 4096, weight: 1}
      - {tokens: 16384, weight: 1}
    decode_tokens: 256        # tokens generated per request: sets the share of prefill vs decode
    reused_prefix: 0.0        # fraction of each prompt that is a cached conversation prefix (not read again)
    draft_acceptance: 0.7     # chance that each MTP draft token is accepted (independent drafts)
    drafter_window: 4096      # positions the drafter's attention reaches back (its K/V ring's span)
    expert_popularity:        # one of:
      skew: 1.0               #   Zipf exponent of expert use within a layer (0 = uniform)
      # histogram: [...]      #   measured counts per expert (one list, or one list per MoE layer)

The objective is the expected time of one request: prefill of the tokens it reads plus `decode_tokens`
decode steps at its depth. Every field is optional; the defaults above are used for what is left out.
"""

from dataclasses import dataclass, field, replace

import numpy as np

from planner.document import read_document
from planner.errors import StratumError

DEFAULT_PROMPT_TOKENS = (512, 4096, 16384)


@dataclass(frozen=True)
class Workload:
    prompts: tuple = tuple((tokens, 1.0) for tokens in DEFAULT_PROMPT_TOKENS)   # (tokens, weight)
    decode_tokens: int = 256
    reused_prefix: float = 0.0
    draft_acceptance: float = 0.7
    drafter_window: int = 4096
    skew: float = 1.0
    histogram: tuple | None = field(default=None, repr=False)

    def for_context(self, context_tokens: int) -> "Workload":
        """Prompts longer than the context are cut to it (a request cannot be longer than the context)."""
        merged: dict[int, float] = {}
        for tokens, weight in self.prompts:
            clipped = min(tokens, context_tokens - min(self.decode_tokens, context_tokens // 2))
            merged[clipped] = merged.get(clipped, 0.0) + weight
        return replace(self, prompts=tuple(sorted(merged.items())))

    def read_tokens(self, prompt_tokens: int) -> int:
        """Tokens a request must compute: the prompt less its reused prefix (at least the last one)."""
        return max(1, prompt_tokens - int(prompt_tokens * self.reused_prefix))

    def popularity(self, n_expert: int, n_used: int, n_layers: int) -> np.ndarray:
        """[n_layers, n_expert]: the chance a token routes to each expert, sorted hottest first; rows sum to
        n_used. What a frequency-based cache holds is a prefix of each row."""
        if self.histogram is not None:
            counts = np.asarray(self.histogram, dtype=np.float64)
            if counts.ndim == 1:
                counts = np.broadcast_to(counts, (n_layers, counts.size))
            if counts.shape != (n_layers, n_expert):
                raise StratumError(f"expert_popularity.histogram has shape {list(counts.shape)}; expected "
                                   f"{n_expert} counts, or {n_layers} lists of {n_expert}", field="workload")
        else:
            ranks = np.arange(1, n_expert + 1, dtype=np.float64)
            counts = np.broadcast_to(ranks ** -self.skew, (n_layers, n_expert))
        share = -np.sort(-counts, axis=1)
        share = share / share.sum(axis=1, keepdims=True)
        return _cap_at_one(share * n_used)


def _cap_at_one(p: np.ndarray) -> np.ndarray:
    """A token picks k distinct experts, so no expert's chance exceeds 1: move the excess to the rest."""
    p = p.copy()
    for _ in range(p.shape[1]):
        over = p > 1.0
        if not over.any():
            break
        excess = (p - 1.0).clip(min=0).sum(axis=1, keepdims=True)
        p[over] = 1.0
        free = np.where(p < 1.0, p, 0.0)
        p += free / np.maximum(free.sum(axis=1, keepdims=True), 1e-300) * excess
    return p


def load_workload(path) -> Workload:
    return parse_workload(read_document(path, "workload") or {}, str(path))


def parse_workload(doc: dict, source: str = "workload") -> Workload:
    if not isinstance(doc, dict):
        raise StratumError("expected a mapping", source=source)
    known = {"prompts", "decode_tokens", "reused_prefix", "draft_acceptance", "drafter_window", "expert_popularity"}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise StratumError(f"unknown field; known: {', '.join(sorted(known))}", source=source, field=unknown[0])
    values = {}
    if "prompts" in doc:
        values["prompts"] = _prompts(doc["prompts"], source)
    for key, low, high, kind in (("decode_tokens", 0, None, int), ("drafter_window", 1, None, int),
                                 ("reused_prefix", 0.0, 0.999, float), ("draft_acceptance", 0.0, 0.999, float)):
        if key in doc:
            values[key] = _number(doc[key], kind, low, high, source, key)
    popularity = doc.get("expert_popularity")
    if popularity is not None:
        if not isinstance(popularity, dict) or len(popularity) != 1 or not set(popularity) <= {"skew", "histogram"}:
            raise StratumError("expected {skew: number} or {histogram: [counts]}", source=source,
                               field="expert_popularity")
        if "skew" in popularity:
            values["skew"] = _number(popularity["skew"], float, 0.0, 10.0, source, "expert_popularity.skew")
        else:
            values["histogram"] = _histogram(popularity["histogram"], source)
    return Workload(**values)


def _prompts(items, source: str) -> tuple:
    if not isinstance(items, list) or not items:
        raise StratumError("expected a non-empty list of {tokens, weight}", source=source, field="prompts")
    prompts = []
    for i, item in enumerate(items):
        where = f"prompts[{i}]"
        if isinstance(item, int) and not isinstance(item, bool):
            item = {"tokens": item}
        if not isinstance(item, dict) or not set(item) <= {"tokens", "weight"} or "tokens" not in item:
            raise StratumError("expected {tokens: N, weight: W}", source=source, field=where)
        prompts.append((_number(item["tokens"], int, 1, None, source, where + ".tokens"),
                        _number(item.get("weight", 1.0), float, 0.0, None, source, where + ".weight")))
    if sum(weight for _, weight in prompts) <= 0:
        raise StratumError("weights sum to zero", source=source, field="prompts")
    return tuple(prompts)


def _histogram(counts, source: str) -> tuple:
    try:
        array = np.asarray(counts, dtype=np.float64)
    except (TypeError, ValueError):
        array = None
    if array is None or array.ndim not in (1, 2) or array.size == 0 or not np.isfinite(array).all() \
            or (array < 0).any() or (array.sum(axis=-1) <= 0).any():
        raise StratumError("expected non-negative counts per expert (a list, or a list per layer), not all zero",
                           source=source, field="expert_popularity.histogram")
    return tuple(map(tuple, array)) if array.ndim == 2 else tuple(array)


def _number(value, kind, low, high, source: str, key: str):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise StratumError(f"expected {'an integer' if kind is int else 'a number'}, got {value!r}",
                           source=source, field=key)
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise StratumError(f"{value} is out of range; expected {bound}", source=source, field=key)
    return kind(value)
