"""The MTP drafter: glm4moe's NextN block, proposing tokens that one verify window of the trunk checks.

Where it lives (the plan's regions): its dense tensors in `drafter_dense`; every routed expert of its block in
`drafter_experts`, a slot each of the experts' slot array (`runtime.experts`: expert e in slot first_slot + e,
which its expert table says; a prompt read with the room open lends them to the ring); its K/V on its own ring
(`drafter_kv`, page table `drafter_page_table`) of `drafter_kv_pages` pages, which hold its window
(`drafter_window_tokens` positions) and one page: no host copy, its attention reads only that window, and a
prompt pass stores only the positions that window can still reach.

What a draft step reads: at position q, the trunk's hidden state at q (after output_norm) and the token at
q + 1; it stores its K/V at q and proposes the token at q + 2 from its head (its shared_head_norm, then the
trunk's output matrix); the next step takes the drafter's own normed output as its hidden state. A prompt's pass
stores the drafter's K/V for each of its positions in the same batched pass (row q with the token at q + 1,
`codegen.graph.build_pass(with_drafter=True)`); the prompt's last position, whose next token is not known then,
is stored again by the first draft step.

Drafts decide only how many tokens a verify window accepts, never which tokens come out: each row of a verify
window gives bitwise the logits of a single decode step (the decode family's window invariance), so greedy
output with drafting is bitwise the output without, whatever the drafter proposes. Sampled output keeps its
distribution instead: drafts are sampled from the drafter's distribution q and accepted by standard speculative
sampling (`speculative_accept`), which emits tokens distributed as the trunk's p.
"""

from dataclasses import dataclass

import numpy as np

from codegen.lower.cuda import copy_rows, cuda
from runtime.kv_ring import KVRing


@dataclass
class DraftStats:
    windows: int = 0            # verify windows that checked drafts
    drafted: int = 0            # tokens proposed
    accepted: int = 0           # of them, tokens the verify window confirmed

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Drafter:
    def __init__(self, arena, tables: dict, kv, hparams, knobs: dict, context_tokens: int, progress, first_slot: int):
        self.layer = hparams.n_trunk
        self.window_tokens = knobs["drafter_window_tokens"]
        self.ring = KVRing(arena, tables["drafter_page_table"], kv, hparams, knobs["drafter_kv_pages"],
                           knobs["page_tokens"], context_tokens, progress, region="drafter_kv", layers=[self.layer],
                           host_copy=False)
        self.expert_slots = tables["drafter_slots"]
        slots = cuda.pinned_array(hparams.n_expert, np.int32)
        slots[:] = first_slot + np.arange(hparams.n_expert)
        copy_rows(self.expert_slots, 0, slots, 0, hparams.n_expert, cuda.default_stream())
        cuda.default_stream().synchronize()
        self.dense = arena.carver("drafter_dense")
        self.weights = {}
        self.stats = DraftStats()

    def load(self, name: str, packed) -> None:
        """One of the NextN block's dense tensors into its region."""
        self.weights[name] = self.dense.weight(packed)

    def lowering(self) -> dict:
        """What `codegen.lower.program.lower` needs for the drafter's block, by argument, for its layer."""
        return {"kv_pages": self.ring.pages, "page_tables": {self.layer: self.ring.page_table},
                "expert_slots": {self.layer: self.expert_slots},
                "attention_windows": {self.layer: self.window_tokens}}

    def record(self, drafted: int, accepted: int) -> None:
        self.stats.windows += 1
        self.stats.drafted += drafted
        self.stats.accepted += accepted


def accepted_drafts(drafts: list, greedy) -> int:
    """How many leading drafts the verify window's greedy tokens confirm: draft i stands where row i's argmax
    (the token after row i's input) says it should."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == int(greedy[accepted]):
        accepted += 1
    return accepted


def probabilities(logits, temperature: float) -> np.ndarray:
    """softmax(logits / temperature) in float64."""
    scaled = np.asarray(logits, np.float64) / temperature
    weights = np.exp(scaled - scaled.max())
    return weights / weights.sum()


def speculative_accept(drafts: list, draft_probs: list, target_probs, rng) -> tuple[int, int]:
    """Standard speculative sampling: draft i (drawn from draft_probs[i]) is kept with probability
    min(1, p_i(d) / q_i(d)), p_i = target_probs[i]; at the first rejection the token is drawn from
    max(0, p_i - q_i), renormalised; when every draft is kept, a last token is drawn from p_n. Returns (drafts
    kept, the token that follows them): the emitted tokens are distributed exactly as sampling from p would."""
    for i, (draft, q) in enumerate(zip(drafts, draft_probs)):
        p = target_probs[i]
        if rng.random() * q[draft] < p[draft]:
            continue
        residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        token = rng.choice(len(p), p=residual / total) if total > 0 else rng.choice(len(p), p=p)
        return i, int(token)
    last = target_probs[len(drafts)]
    return len(drafts), int(rng.choice(len(last), p=last))
