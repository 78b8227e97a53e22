"""The search (`planner.solve` is its entry point): the VRAM layout that minimises the workload's expected request time.

Variables: prefill chunk (powers of two), K/V ring pages, prefill ring slots, expert cache slots per GPU,
MTP draft depth, and the drafter room's threshold. For each chunk, every (K/V pages, ring slots) pair of a
grid is priced at once with numpy; the expert cache takes what is left of each GPU, since more cache never
costs time (it only removes streaming and zero-copy reads). A request lends the K/V pages it cannot reach to
the decode cache (planner.kv_lending), so decode is priced with those slots too. The best point is then refined
one page and one slot at a time. The drafter's window comes from the workload; the room's threshold is the shortest read
whose prefill gain exceeds the cost of copying the drafter's experts back.
"""

from dataclasses import dataclass, field

import numpy as np

from codegen.graph import build_pass, representative_layers
from codegen.memory import plan_arena
from planner.errors import DoesNotFit, StratumError
from planner.kv import KVType, parse_kv_type
from planner.kv_lending import lent_slot_count, page_parts
from planner.architecture import tensor_layer
from planner.layout import aligned, carve, fixed_region_sizes, host_page_table_bytes, kv_ring_bytes
from planner.model import Model, load_model
from planner.plan import Plan
from planner.predict import MAX_DRAFT_DEPTH, DeviceCost, DeviceShare
from planner.profile import Profile, load_profile
from planner.units import format_bytes
from planner.workload import Workload, load_workload

PAGE_TOKENS = 256
MIN_CHUNK_TOKENS, MAX_CHUNK_TOKENS = 64, 16384
MIN_RING_SLOTS = 2          # one slot being computed on while the next is copied
RING_SLOT_GRID = tuple(range(2, 33)) + (40, 48, 56, 64, 80, 96, 128, 160, 192, 256)
DEFAULT_CONTEXT_TOKENS = 32768
TIE_TOLERANCE = 1e-6     # relative: objectives closer than this are equal


@dataclass
class Problem:
    """Everything a layout is priced from."""
    model: Model
    profile: Profile
    kv: KVType
    context_tokens: int
    mtp: bool
    workload: Workload
    page_tokens: int
    shares: list            # DeviceShare per GPU
    costs: list             # DeviceCost per GPU
    fixed_sizes: list       # per GPU: the regions no knob changes (layout.fixed_region_sizes)
    expert_host_bytes: list     # per GPU: the pinned host copy of its blocks' routed experts
    arenas: dict = field(default_factory=dict)     # chunk tokens -> arena bytes, memoised
    pass_arenas: dict = field(default_factory=dict)    # (pass kind, tokens) -> its arena bytes, memoised
    lent: dict = field(default_factory=dict)       # (GPU, request tokens) -> lent slots per ring size, memoised

    def fixed_bytes(self, device: int) -> int:
        return sum(aligned(size) for size in self.fixed_sizes[device].values())

    @property
    def slot_bytes(self) -> int:
        return self.model.slot_layout.slot_bytes

    @property
    def full_pages(self) -> int:
        return -(-self.context_tokens // self.page_tokens)

    def min_pages(self, chunk_tokens: int) -> int:
        """A chunk's positions never share a slot, and a chunk can straddle one extra page."""
        return min(-(-chunk_tokens // self.page_tokens) + 1, self.full_pages)

    def resident_tokens(self, pages):
        """Positions whose K/V is in VRAM: all when the ring holds the context, else every full page."""
        pages = np.asarray(pages)
        return np.where(pages >= self.full_pages, self.context_tokens, (pages - 1) * self.page_tokens)

    def resident_at(self, pages, depth):
        """Positions 0..depth that a decode step at `depth` finds in VRAM: its ring holds the pages from the one it
        writes back, the older ones only in the host copy (never fewer than `resident_tokens`)."""
        pages, depth = np.asarray(pages), np.asarray(depth)
        host_pages = np.maximum(depth // self.page_tokens + 1 - pages, 0)
        return np.where(pages >= self.full_pages, depth, depth - host_pages * self.page_tokens)

    @property
    def drafter_pages(self) -> int:
        """The drafter's K/V ring: its window and one page (a window straddles one more). A prompt pass stores
        only the positions the drafter's window can still reach (the prompt's last `drafter_window`), so no
        two positions of one chunk share a slot whatever the chunk's size."""
        if not self.mtp:
            return 0
        window_pages = -(-min(self.workload.drafter_window, self.context_tokens) // self.page_tokens)
        return min(window_pages + 1, self.full_pages)

    @property
    def room_slots(self) -> int:
        return self.fixed_sizes[-1].get("drafter_experts", 0) // self.slot_bytes

    @property
    def room_reclaim_s(self) -> float:
        """Giving the room back: the drafter's experts copied in again before the first decode window."""
        gpu = self.shares[-1].gpu
        return gpu.copy_latency_s + self.model.drafter_expert_bytes / gpu.host_to_device_bytes_per_s

    def kv_bytes(self, device: int, pages) -> int:
        return kv_ring_bytes(pages, self.page_tokens, self.model.kv_bytes_per_token(self.kv),
                             len(self.shares[device].blocks))

    @property
    def drafter_kv_bytes(self) -> int:
        return kv_ring_bytes(self.drafter_pages, self.page_tokens,
                             self.model.kv_bytes_per_token(self.kv), self.model.hparams.n_nextn)

    def arena_bytes(self, chunk_tokens: int) -> int:
        """The largest pass: a prefill chunk, a verify window of 1 + MAX_DRAFT_DEPTH, a draft step."""
        if chunk_tokens not in self.arenas:
            self.arenas[chunk_tokens] = self._arena_bytes(chunk_tokens)
        return self.arenas[chunk_tokens]

    def _arena_bytes(self, chunk_tokens: int) -> int:
        passes = [("prefill", chunk_tokens), ("decode", 1 + (MAX_DRAFT_DEPTH if self.mtp else 0))]
        if self.mtp:
            passes.append(("draft", 1))
        return aligned(max(self._pass_arena_bytes(kind, tokens) for kind, tokens in passes))

    def _pass_arena_bytes(self, kind: str, tokens: int) -> int:
        """One pass's activation arena, remembered (the decode and draft passes serve every chunk size)."""
        key = (kind, tokens)
        if key not in self.pass_arenas:
            self.pass_arenas[key] = plan_arena(build_pass(self.model, kind, tokens, self.kv,
                                                          layers=representative_layers(self.model.hparams),
                                                          with_drafter=self.mtp)).size_bytes
        return self.pass_arenas[key]

    def pinned_bytes(self, device: int, pages, experts: bool) -> dict:
        """Pinned host memory the runtime takes at start for GPU `device`, by what it holds: its blocks' routed
        experts when some can miss (`experts`), the whole context's K/V of its blocks unless the ring holds it
        (numpy arrays of pages broadcast), and on the last GPU the drafter's experts when the plan has a room
        (closing it copies them back; the engine can open a room the plan keeps shut)."""
        return {"experts": self.expert_host_bytes[device] if experts else 0,
                "kv": np.where(np.asarray(pages) < self.full_pages, self.kv_bytes(device, self.full_pages), 0),
                "drafter_experts": self.model.drafter_expert_bytes
                if self.shares[device].last and self.room_slots else 0}

    def cache_slots_max(self, device: int) -> int:
        return len(self.costs[device].moe_blocks) * self.model.hparams.n_expert

    def request_tokens(self, depth):
        """The positions of a request whose decode steps average `depth` (its prompt, then the workload's
        decode tokens around it): what its K/V ring must hold."""
        decode = self.workload.decode_tokens
        return np.minimum(np.asarray(depth) + decode - decode // 2, self.context_tokens)

    def decode_cache_slots(self, pages, cache_slots: list, depth) -> list:
        """Per GPU, the cache slots decode has at `depth`: the plan's, and those the K/V ring's unreached pages
        lend (planner.kv_lending; numpy arrays of pages and slots broadcast)."""
        request = int(self.request_tokens(depth))
        return [slots + self._lent_by_pages(device, request)[np.asarray(pages)]
                for device, slots in enumerate(cache_slots)]

    def _lent_by_pages(self, device: int, request_tokens: int) -> np.ndarray:
        """[ring pages] -> the slots a request lends, for every ring size up to the whole context (the search
        prices thousands of layouts, but a ring has at most full_pages sizes)."""
        key = (device, request_tokens)
        if key not in self.lent:
            hp = self.model.hparams
            parts = page_parts(self.kv, self.page_tokens, hp.n_head_kv, hp.head_dim_k, hp.head_dim_v)
            self.lent[key] = lent_slot_count(parts, len(self.shares[device].blocks), np.arange(self.full_pages + 1),
                                             request_tokens, self.page_tokens, self.slot_bytes)
        return self.lent[key]


@dataclass
class Knobs:
    chunk_tokens: int
    kv_pages: int
    ring_slots: int
    cache_slots: tuple          # per GPU
    draft_depth: int
    room_min_read_tokens: int | None     # None: the room never opens
    drafter_window_tokens: int


def make_problem(hardware, model, context=None, kv="f16", mtp=None, workload=None,
                 page_tokens: int = PAGE_TOKENS) -> Problem:
    profile = hardware if isinstance(hardware, Profile) else load_profile(hardware)
    model = model if isinstance(model, Model) else load_model(model)
    kv_type = kv if isinstance(kv, KVType) else parse_kv_type(kv)
    if workload is None:
        workload = Workload()
    elif not isinstance(workload, Workload):
        workload = load_workload(workload)
    if mtp is None:
        mtp = model.has_drafter
    if mtp and not model.has_drafter:
        raise StratumError(f"{model.name} has no NextN (MTP) block to draft with; plan without --mtp",
                           field="mtp")
    context = context or min(model.hparams.n_ctx_train, DEFAULT_CONTEXT_TOKENS)
    if context < 2 * MIN_CHUNK_TOKENS:
        raise StratumError(f"context {context} is too short; at least {2 * MIN_CHUNK_TOKENS} tokens",
                           field="context")
    if context > model.hparams.n_ctx_train:
        raise StratumError(f"context {context} exceeds the model's trained context of "
                           f"{model.hparams.n_ctx_train} tokens", field="context")
    workload = workload.for_context(context)
    shares = split_blocks(model, profile)
    costs = [DeviceCost(model, share, kv_type, workload, mtp) for share in shares]
    full_pages = -(-context // page_tokens)
    fixed = [fixed_region_sizes(model, share.blocks, share.first, share.last, mtp, full_pages) for share in shares]
    expert_host = [sum(t.n_bytes for t in model.tensors if model.tensor_class[t.name] == "expert"
                       and tensor_layer(t.name) in share.blocks) for share in shares]
    return Problem(model, profile, kv_type, context, mtp, workload, page_tokens, shares, costs, fixed, expert_host)


def split_blocks(model: Model, profile: Profile) -> list[DeviceShare]:
    """Contiguous trunk blocks per GPU, in proportion to each GPU's usable VRAM (the drafter goes last)."""
    gpus = profile.gpus
    n_blocks = model.hparams.n_trunk
    if len(gpus) > n_blocks:
        raise StratumError(f"{len(gpus)} GPUs for {n_blocks} blocks: at least one block per GPU", field="gpus")
    usable = np.array([g.usable_bytes for g in gpus], dtype=np.float64)
    bounds = np.round(np.cumsum(usable) / usable.sum() * n_blocks).astype(int)
    bounds = np.maximum(bounds, np.arange(1, len(gpus) + 1))    # every GPU gets a block
    shares, start = [], 0
    for i, gpu in enumerate(gpus):
        end = n_blocks if i == len(gpus) - 1 else min(int(bounds[i]), n_blocks - (len(gpus) - 1 - i))
        shares.append(DeviceShare(i, gpu, tuple(range(start, end)), first=i == 0, last=i == len(gpus) - 1))
        start = end
    return shares


# --- pricing ---------------------------------------------------------------------------------------------

def request_s(problem: Problem, chunk: int, pages, ring_slots, cache_slots: list, draft_depth: int | None = None):
    """Expected seconds of one request of the workload, for arrays of layouts (broadcast together), at the
    best draft depth for the whole workload (one depth per plan) or at `draft_depth`."""
    wl = problem.workload
    weights = np.array([w for _, w in wl.prompts], dtype=np.float64)
    prefill_total = 0.0
    for prompt_tokens, weight in wl.prompts:
        read = wl.read_tokens(prompt_tokens)
        start = prompt_tokens - read
        shut = prefill_s(problem, read, start, chunk, pages, ring_slots, cache_slots, room=False)
        opened = prefill_s(problem, read, start, chunk, pages, ring_slots, cache_slots, room=True) \
            + problem.room_reclaim_s if problem.room_slots else shut
        prefill_total = prefill_total + weight * np.minimum(shut, opened)
    decode = [decode_per_draft_depth(problem, tokens + wl.decode_tokens // 2, pages, cache_slots)
              for tokens, _ in wl.prompts]
    best = None
    for depth in draft_depth_options(problem) if draft_depth is None else [draft_depth]:
        decode_total = sum(weight * wl.decode_tokens * per_depth[depth]
                           for (_, weight), per_depth in zip(wl.prompts, decode))
        best = decode_total if best is None else np.minimum(best, decode_total)
    return (prefill_total + best) / weights.sum()


def draft_depth_options(problem: Problem) -> range:
    return range(0, MAX_DRAFT_DEPTH + 1) if problem.mtp else range(0, 1)


def best_draft_depth(problem: Problem, chunk: int, pages: int, ring: int, cache: list) -> int:
    return min(draft_depth_options(problem),
               key=lambda depth: float(request_s(problem, chunk, pages, ring, cache, depth)))


def prefill_s(problem: Problem, read: int, start: int, chunk: int, pages, ring_slots, cache_slots, room: bool):
    """Chunks pass every GPU in turn: the times add up."""
    resident = problem.resident_tokens(pages)
    total = 0.0
    for cost, slots in zip(problem.costs, cache_slots):
        ring = ring_slots + (problem.room_slots if room and cost.share.last else 0)
        total = total + cost.prefill_s(read, chunk, slots, ring, resident, start)
    return total


def decode_per_draft_depth(problem: Problem, depth: int, pages, cache_slots) -> list:
    """Seconds per generated token at `depth` for each draft depth (index 0: no drafting), the expert cache
    grown by the K/V pages a request of that depth lends it."""
    resident = problem.resident_at(pages, depth)
    cache_slots = problem.decode_cache_slots(pages, cache_slots, depth)
    step = sum(c.window_s(1, depth, s, resident) for c, s in zip(problem.costs, cache_slots))
    per_depth = [step]
    if problem.mtp:
        draft = sum(c.draft_s(depth, problem.workload.drafter_window) for c in problem.costs)
        a = problem.workload.draft_acceptance
        for n in range(1, MAX_DRAFT_DEPTH + 1):
            verify = sum(c.window_s(1 + n, depth, s, resident) for c, s in zip(problem.costs, cache_slots))
            per_depth.append((n * draft + verify) / sum(a ** i for i in range(n + 1)))
    return per_depth


# --- search ----------------------------------------------------------------------------------------------

def chunk_candidates(problem: Problem) -> list[int]:
    longest = max(problem.workload.read_tokens(t) for t, _ in problem.workload.prompts)
    top = min(MAX_CHUNK_TOKENS, 1 << max(0, (longest - 1).bit_length()))
    chunks, chunk = [], MIN_CHUNK_TOKENS
    while chunk <= max(top, MIN_CHUNK_TOKENS):
        chunks.append(chunk)
        chunk *= 2
    return chunks


def page_candidates(problem: Problem, chunk: int) -> np.ndarray:
    """Every page count when there are few; else a geometric grid plus the workload's depths."""
    low, high = problem.min_pages(chunk), problem.full_pages
    if high - low <= 64:
        return np.arange(low, high + 1)
    grid = set(np.unique(np.geomspace(low, high, 48).round().astype(int)).tolist()) | {low, high}
    for prompt_tokens, _ in problem.workload.prompts:
        for depth in (prompt_tokens, prompt_tokens + problem.workload.decode_tokens):
            pages = -(-depth // problem.page_tokens) + 1
            grid |= {p for p in (pages - 1, pages, pages + 1) if low <= p <= high}
    return np.array(sorted(grid))


def feasible_cache(problem: Problem, chunk: int, pages, ring_slots, arena: int):
    """Cache slots each GPU gets from what is left (negative: the layout does not fit), after the page tables
    that map its pinned host copies: the experts' copy is not taken when every expert is cached."""
    slots = []
    for i, share in enumerate(problem.shares):
        used = problem.fixed_bytes(i) + aligned(problem.kv_bytes(i, pages)) + aligned(ring_slots * problem.slot_bytes) \
            + arena
        if share.last and problem.mtp:
            used = used + aligned(problem.drafter_kv_bytes)
        left = share.gpu.usable_bytes - used
        pinned = problem.pinned_bytes(i, pages, experts=False)
        others = pinned["kv"] + pinned["drafter_experts"]
        most = problem.cache_slots_max(i)
        every = left - host_page_table_bytes(share.gpu, others) >= most * problem.slot_bytes
        some = (left - host_page_table_bytes(share.gpu, others + problem.expert_host_bytes[i])) // problem.slot_bytes
        slots.append(np.where(every, most, np.where(some >= 0, some, -1)))
    return slots


def search(problem: Problem, pins: dict | None = None) -> Knobs:
    """The best layout; `pins` fixes any of chunk_tokens, kv_pages, ring_slots to a given value."""
    pins = dict(pins or {})
    unknown = set(pins) - {"chunk_tokens", "kv_pages", "ring_slots"}
    if unknown:
        raise StratumError(f"cannot pin {sorted(unknown)}; pin chunk_tokens, kv_pages or ring_slots")
    chunks = [pins["chunk_tokens"]] if "chunk_tokens" in pins else chunk_candidates(problem)
    if chunks[0] < 1:
        raise StratumError("must be at least 1", field="chunk_tokens")
    if pins.get("ring_slots", MIN_RING_SLOTS) < MIN_RING_SLOTS:
        raise StratumError(f"must be at least {MIN_RING_SLOTS}", field="ring_slots")
    best = None      # (objective, chunk, pages, ring, arena)
    for chunk in chunks:
        arena = problem.arena_bytes(chunk)
        if "kv_pages" in pins:
            if not problem.min_pages(chunk) <= pins["kv_pages"] <= problem.full_pages:
                raise StratumError(f"must be between {problem.min_pages(chunk)} (a {chunk}-token chunk and one page) "
                                   f"and {problem.full_pages} (the whole context)", field="kv_pages")
            pages = np.array([[pins["kv_pages"]]])
        else:
            pages = page_candidates(problem, chunk)[:, None]
        rings = np.array([[pins["ring_slots"]]]) if "ring_slots" in pins else np.array(RING_SLOT_GRID)[None, :]
        point = _best_on_grid(problem, chunk, arena, pages, rings)
        if point is not None and (best is None or point[0] < best[0] * (1 - TIE_TOLERANCE)):
            best = point + (arena,)
    if best is None:
        raise refusal(problem)
    _, chunk, pages, ring, arena = best
    if not {"kv_pages", "ring_slots"} <= set(pins):
        pages, ring = _refine(problem, chunk, arena, pages, ring, pins)
    cache = [int(s) for s in feasible_cache(problem, chunk, pages, ring, arena)]
    return Knobs(chunk_tokens=chunk, kv_pages=int(pages), ring_slots=int(ring), cache_slots=tuple(cache),
                 draft_depth=best_draft_depth(problem, chunk, pages, ring, cache),
                 room_min_read_tokens=room_threshold(problem, chunk, pages, ring, cache),
                 drafter_window_tokens=min(problem.workload.drafter_window, problem.context_tokens)
                 if problem.mtp else 0)


def _best_on_grid(problem, chunk, arena, pages, rings):
    """The grid's best point; among points within TIE_TOLERANCE of it, the most K/V pages (longer requests
    keep their speed), then the fewest ring slots (VRAM left free)."""
    pages, rings = np.broadcast_arrays(pages, rings)
    cache = feasible_cache(problem, chunk, pages, rings, arena)
    ok = np.all([c >= 0 for c in cache], axis=0)
    if not ok.any():
        return None
    pages, rings = pages[ok], rings[ok]
    cache = [c[ok] for c in cache]
    objective = request_s(problem, chunk, pages, rings, cache)
    near = objective <= objective.min() * (1 + TIE_TOLERANCE)
    i = int(np.lexsort((rings, -pages, ~near))[0])
    return float(objective[i]), chunk, int(pages[i]), int(rings[i])


def _refine(problem, chunk, arena, pages, ring, pins):
    """Hill-climb on the integer neighbours of the grid's best point until none is better."""
    low, high = problem.min_pages(chunk), problem.full_pages
    current = _best_on_grid(problem, chunk, arena, np.array([pages]), np.array([ring]))[0]
    steps = np.array([-8, -2, -1, 0, 1, 2, 8])
    for _ in range(256):
        page_options = np.array([pins["kv_pages"]]) if "kv_pages" in pins else np.unique(np.clip(pages + steps, low, high))
        ring_options = np.array([pins["ring_slots"]]) if "ring_slots" in pins else \
            np.unique(np.clip(ring + steps, MIN_RING_SLOTS, None))
        point = _best_on_grid(problem, chunk, arena, page_options[:, None], ring_options[None, :])
        if point[0] >= current * (1 - TIE_TOLERANCE) and (point[2], point[3]) == (pages, ring):
            break
        if point[0] > current * (1 + TIE_TOLERANCE):
            break
        current, _, pages, ring = point
    return pages, ring


def room_threshold(problem: Problem, chunk: int, pages: int, ring: int, cache: list) -> int | None:
    """The shortest read (tokens) for which opening the room saves more than giving it back costs."""
    if not problem.room_slots:
        return None

    def gain(read: int) -> float:
        shut = prefill_s(problem, read, 0, chunk, pages, ring, cache, room=False)
        opened = prefill_s(problem, read, 0, chunk, pages, ring, cache, room=True)
        return float(shut - opened) - problem.room_reclaim_s

    high = problem.context_tokens
    if gain(high) <= 0:
        return None
    low = 1
    while low < high:           # the gain grows with the read: bisect for its first positive point
        mid = (low + high) // 2
        if gain(mid) > 0:
            high = mid
        else:
            low = mid + 1
    return low


def refusal(problem: Problem) -> DoesNotFit:
    """The smallest layout and what it lacks: say by how much, and which region is the floor."""
    chunk = MIN_CHUNK_TOKENS
    messages = []
    for i, share in enumerate(problem.shares):
        fixed = problem.fixed_sizes[i]
        need = {"dense weights": fixed["dense"],
                "K/V ring (minimum)": problem.kv_bytes(i, problem.min_pages(chunk)),
                "prefill ring (2 slots)": MIN_RING_SLOTS * problem.slot_bytes,
                "activation arena": problem.arena_bytes(chunk), "tables": fixed["tables"]}
        if share.last and problem.mtp:
            need["drafter (MTP)"] = aligned(fixed["drafter_dense"]) + aligned(fixed["drafter_experts"]) + \
                problem.drafter_kv_bytes
        total = sum(aligned(v) for v in need.values())
        if total > share.gpu.usable_bytes:
            floor = max(need, key=need.get)
            parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in need.items())
            hint = " (plan without --mtp to drop it)" if floor.startswith("drafter") else \
                " (a smaller quantization, or more GPUs)" if floor == "dense weights" else ""
            messages.append(f"GPU {i} ({share.gpu.name}) needs at least {format_bytes(total)} ({parts}) but has "
                            f"{format_bytes(share.gpu.usable_bytes)} usable: {format_bytes(total - share.gpu.usable_bytes)} "
                            f"short; the floor is the {floor}{hint}")
    if not messages:
        messages.append("no layout fits")
    return DoesNotFit(f"{problem.model.name} does not fit {problem.profile.name}: " + "; ".join(messages))


def regions(problem: Problem, knobs: Knobs) -> list:
    """Every GPU's regions, byte-exact, in carve order."""
    result = []
    for i, share in enumerate(problem.shares):
        sizes = {**problem.fixed_sizes[i],
                 "kv_ring": problem.kv_bytes(i, knobs.kv_pages),
                 "expert_cache": knobs.cache_slots[i] * problem.slot_bytes,
                 "prefill_ring": knobs.ring_slots * problem.slot_bytes,
                 "arena": problem.arena_bytes(knobs.chunk_tokens)}
        if share.last and problem.mtp:
            sizes["drafter_kv"] = problem.drafter_kv_bytes
        result.extend(carve(i, sizes))
    return result


def pinned_host_bytes(problem: Problem, knobs: Knobs) -> list[dict]:
    """Per GPU, the pinned host memory the runtime takes at start under these knobs (`Problem.pinned_bytes`)."""
    return [{part: int(size) for part, size in problem.pinned_bytes(
                i, knobs.kv_pages, experts=knobs.cache_slots[i] < problem.cache_slots_max(i)).items()}
            for i in range(len(problem.shares))]


def check_host(problem: Problem, knobs: Knobs):
    need = {part: sum(device[part] for device in pinned_host_bytes(problem, knobs))
            for part in ("experts", "kv", "drafter_experts")}
    budget = problem.profile.host.pinned_budget_bytes
    if sum(need.values()) > budget:
        drafter = f", the drafter's experts {format_bytes(need['drafter_experts'])}" if need["drafter_experts"] else ""
        raise DoesNotFit(f"{problem.model.name} does not fit {problem.profile.name}'s host: the pinned copies need "
                         f"{format_bytes(sum(need.values()))} (routed experts {format_bytes(need['experts'])}, "
                         f"K/V for {problem.context_tokens} positions {format_bytes(need['kv'])}{drafter}) but "
                         f"host.pinned_budget is {format_bytes(budget)}: "
                         f"{format_bytes(sum(need.values()) - budget)} short")


def solve(hardware, model, context=None, kv="f16", mtp=None, workload=None,
          page_tokens: int = PAGE_TOKENS, pins: dict | None = None) -> Plan:
    """Plan a model (GGUF path, card path or bundled card name) on hardware (profile name or path).

    context: positions per conversation (default: the model's, at most 32768); kv: K/V type (f16, q8_0, k8v4,
    ...); mtp: draft with the NextN block (default: when the model has one); workload: a Workload or a YAML
    path; pins: knobs to hold fixed (chunk_tokens, kv_pages, ring_slots)."""
    from planner.assemble import assemble     # imported here: assemble builds on this module

    problem = make_problem(hardware, model, context, kv, mtp, workload, page_tokens)
    knobs = search(problem, pins)
    check_host(problem, knobs)
    return assemble(problem, knobs)
