"""The engine: a plan executed on one GPU.

    with Engine(plan, "model.gguf") as engine:
        out = engine.generate(prompt_ids, max_new_tokens=256)      # greedy by default
        for token in engine.stream(prompt_ids, max_new_tokens=64, temperature=0.7): ...
        print(engine.stats())

Start: the plan's bytes as one device allocation (`runtime.arena`), carved into its regions: dense weights,
the K/V ring (page p in slot p mod pages, and a host copy of the whole context when the ring is shorter:
`runtime.kv_ring`), expert slots and the experts' host copy (`runtime.experts`), the activation arena, the
tables; with the plan's MTP drafter, its tensors, experts and K/V ring (`runtime.drafter`). Then kernels
compile (a warm-up prompt and step) and the decode step is captured as a CUDA graph. A request reads its
prompt in chunks of the plan's size (each block's routed experts streamed through the prefill ring), then
decodes by replaying captured graphs: a step at a time, or with drafting (`draft_depth` n > 0, greedy) n draft
steps of the drafter and one verify window of 1 + n rows, whose greedy tokens are bitwise a step's.

Conversations: the K/V of the last request's prompt stays in the ring; a request of the same conversation
whose prompt starts with it reads only the rest. Only prompt positions are reused: generated tokens' K/V was
computed by the decode family, whose sums differ in the last bits from the prefill family's, and a reused
conversation must give bitwise the logits of a cold read.

The K/V ring sized per request: a request whose prompt and new tokens need fewer pages than the plan's ring
lends the other pages' bytes to the expert cache for its decode (`planner.kv_lending`, `ExpertStore.lend`), in
place; the next request that needs them takes them back. The lent slots are filled after the prompt is read,
on the copy stream, like any cache refresh; logits never depend on it (DESIGN.md invariant 2).
"""

import time
from dataclasses import dataclass, field

import numpy as np

from codegen.lower import MAX_WINDOW
from codegen.lower.cuda import (SIMULATOR, CapturedGraph, copy_rows, cuda, kernel_counts, mapped_device_view,
                                mapped_filled)
from codegen.lower.program import arena_layout, lower
from codegen.lower.weights import check_swiglu_types, iter_gguf
from planner.architecture import tensor_layer
from planner.errors import StratumError
from planner.header import read_header
from planner.kv import parse_kv_type
from planner.kv_lending import lent_slots, needed_pages
from planner.layout import table_sizes
from planner.model import load_model
from planner.predict import MAX_DRAFT_DEPTH
from runtime.arena import DeviceArena
from runtime.drafter import Drafter, accepted_drafts, probabilities, speculative_accept
from runtime.experts import MATRICES, REFRESH_STEPS, ExpertStore, expert_layout
from runtime.kv_ring import KVRing
from runtime.progress import Progress


@dataclass
class Generation:
    tokens: list                    # the new token ids
    logits: np.ndarray | None       # (len(tokens), vocab) float32: the logits each token was chosen from
    prompt_tokens: int
    reused_tokens: int              # prompt positions whose K/V was reused (the conversation's prefix)
    prefill_s: float
    decode_s: float
    first_token_s: float            # from the call to the first new token


@dataclass
class _Totals:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    requests: int = 0
    reused_tokens: int = 0
    prompt_lengths: dict = field(default_factory=dict)     # prompt tokens -> requests
    last: dict = field(default_factory=dict)


class Engine:
    def __init__(self, plan, model, progress: bool = True, seed: int | None = None, tensors=None,
                 refresh_steps: int = REFRESH_STEPS, room_min_read_tokens="plan", drafter_kv_pass: str = "batched",
                 kv_lending: bool = True):
        """model: the GGUF file the plan was made for (or a model card, with `tensors`); tensors: (name,
        PackedWeight) pairs to load instead of the file's data (benchmarks build weights in memory);
        refresh_steps: decode steps between expert-cache refreshes; room_min_read_tokens: the drafter room
        opens for requests that read at least this many prompt tokens: "plan" (the plan's threshold), a
        number (0: every request), or None (never: the A/B switch); drafter_kv_pass: how a prompt's drafter
        K/V is stored: "batched" (in the prompt's own pass) or "per_row" (the drafter's own pass, a draft step
        a position, the A/B switch); kv_lending: a request that needs fewer K/V pages than the plan's ring
        lends the rest to the expert cache for its decode (False: never, the A/B switch)."""
        self.refresh_steps = refresh_steps
        started = time.perf_counter()
        self.progress = Progress(progress)
        self.model = load_model(model)
        if tensors is None:
            if str(self.model.source).lower().endswith((".yaml", ".yml")):
                raise StratumError(f"{self.model.name} is a model card: it has no weights to run (pass tensors=)")
            tensors = iter_gguf(self.model.source, read_header(self.model.source))
        plan.check_matches(model=self.model)
        if len(plan.devices) != 1:
            raise StratumError(f"this plan spans {len(plan.devices)} GPUs; the runtime drives one")
        self.plan, self.hp = plan, self.model.hparams
        self.knobs, settings = plan.knobs, plan.settings
        self.kv = parse_kv_type(settings["kv"])
        self.chunk_tokens = self.knobs["chunk_tokens"]
        self.max_tokens = settings["context_tokens"]
        self.rng = np.random.default_rng(seed)
        self.moe_blocks = [b for b in range(self.hp.n_trunk) if self.hp.is_moe_layer(b)]
        check_swiglu_types(self.model)      # refused before anything is allocated
        layout = expert_layout(self.model)
        self.arena = DeviceArena(plan)
        self.compute = cuda.stream()
        self._carve_tables(settings["context_tokens"])
        self.kv_ring = KVRing(self.arena, self.tables["page_table"], self.kv, self.hp, self.knobs["kv_pages"],
                              self.knobs["page_tokens"], settings["context_tokens"], self.progress)
        self.experts = ExpertStore(self.arena, self.tables, self.moe_blocks, *layout,
                                   self.model.slot_layout, self.knobs["expert_cache_slots"][0],
                                   self.knobs["prefill_ring_slots"], self.refresh_steps,
                                   self._traced_popularity(settings))
        self.kv_lending = kv_lending and self.experts.needs_host and self.experts.lendable_slots > 0
        self.drafter = None
        if self._has_drafter():
            self.drafter = Drafter(self.arena, self.tables, self.kv, self.hp, self.knobs, settings["context_tokens"],
                                   self.progress, self.experts.room_first)
        self.draft_depth = self.knobs.get("draft_depth", 0) if self.drafter else 0
        self.room_min_read_tokens = self._check_room(room_min_read_tokens)
        self.drafter_kv_pass = self._check_drafter_kv_pass(drafter_kv_pass)
        self._load_weights(tensors)
        self.programs, self.graphs = {}, {}
        # a decode window's routed ids and a decode window's or draft step's greedy tokens, which their launches
        # write in place (mapped host memory: no copy node in the captured step, BENCHMARKS.md run 53)
        self.decode_ids = mapped_filled((len(self.moe_blocks), MAX_WINDOW, self.hp.n_expert_used), np.int32)
        self.greedy = mapped_filled(MAX_WINDOW, np.int32)
        self.decode_ids_view, self.greedy_view = mapped_device_view(self.decode_ids), mapped_device_view(self.greedy)
        self.staging = cuda.pinned_array((3, self.chunk_tokens), np.int32)
        # pinned destinations of the routed ids prefill reads back per block and of the hidden states the
        # drafter reads (a verify window's rows; the one the next draft step takes)
        self.routed_ids = cuda.pinned_array((len(self.moe_blocks), self.chunk_tokens, self.hp.n_expert_used),
                                            np.int32)
        # a MoE block's routed ids copied: the host counts them while the GPU goes on with the chunk's later blocks
        self.routed_copied = [cuda.event() for _ in self.moe_blocks]
        self.last_logits = cuda.pinned_array((1, self.hp.n_vocab), np.float32)     # a prompt's last position's
        self.hiddens = cuda.pinned_array((MAX_WINDOW, self.hp.n_embd), np.float32)
        self.hidden = cuda.pinned_array((1, self.hp.n_embd), np.float32)
        self.hidden[:] = 0
        if self.drafter_kv_pass == "per_row":       # a chunk's hidden states, which the drafter's own pass reads
            self.prompt_hiddens = cuda.pinned_array((self.chunk_tokens, self.hp.n_embd), np.float32)
        self.kv_owner = None            # (conversation, prompt tokens whose K/V the ring holds)
        self.totals = _Totals()
        self._program("prefill", self.chunk_tokens).bind()     # the pass most prompt chunks run
        self._warm_up()
        self.startup_s = time.perf_counter() - started

    # ---------------------------------------------------------------------------------------------------
    # start

    def _has_drafter(self) -> bool:
        """Whether the plan runs the MTP drafter (it made room for it: the model has a NextN layer and
        speculative decoding is on)."""
        return bool(self.plan.settings.get("mtp")) and self.hp.n_nextn > 0 and self.arena.has("drafter_kv")

    def _check_room(self, room_min_read_tokens):
        """The threshold the room opens at (None: never), refused where the engine has no room to lend."""
        if room_min_read_tokens == "plan":
            return self.knobs.get("room_min_read_tokens") if self.drafter else None
        if room_min_read_tokens is None:
            return None
        if self.drafter is None:
            raise StratumError(f"room_min_read_tokens {room_min_read_tokens}: there is no drafter room to open "
                               f"({self._no_drafter_reason()})")
        if not isinstance(room_min_read_tokens, int) or room_min_read_tokens < 0:
            raise StratumError(f"room_min_read_tokens {room_min_read_tokens!r}: \"plan\", a number of tokens >= 0, "
                               "or None (never)")
        return room_min_read_tokens

    def _check_drafter_kv_pass(self, drafter_kv_pass: str) -> str:
        if drafter_kv_pass not in ("batched", "per_row"):
            raise StratumError(f"drafter_kv_pass {drafter_kv_pass!r}: \"batched\" or \"per_row\"")
        if drafter_kv_pass == "per_row" and self.drafter is None:
            raise StratumError(f"drafter_kv_pass 'per_row': this engine has no drafter ({self._no_drafter_reason()})")
        return drafter_kv_pass

    def _no_drafter_reason(self) -> str:
        return ("the model has no NextN layer" if not self.hp.n_nextn
                else "the plan was made without speculative decoding (no drafter regions)")

    def _carve_tables(self, context_tokens: int) -> None:
        full_pages = -(-context_tokens // self.knobs["page_tokens"])
        carver = self.arena.carver("tables")
        sizes = table_sizes(full_pages, self.hp.n_expert, self.moe_blocks, drafter=self._has_drafter())
        self.tables = {name: carver.array((size // 4,), np.int32) for name, size in sizes.items()}

    def _load_weights(self, tensors) -> None:
        dense = self.arena.carver("dense")
        self.weights = {}
        loaded = ("dense", "expert", "drafter_dense", "drafter_expert") if self.drafter else ("dense", "expert")
        total = sum(t.n_bytes for t in self.model.tensors if self.model.tensor_class[t.name] in loaded)
        self.progress.start("loading weights" + (" (host copy of the experts pinned)" if self.experts.needs_host
                                                 else ""), total, "B")
        for name, packed in tensors:
            kind = self.model.tensor_class[name]
            if kind == "dense":
                self.weights[name] = dense.weight(packed)
            elif kind == "expert":
                self.experts.load(tensor_layer(name), name.split(".")[2], packed)
            elif self.drafter is None:
                continue        # the drafter's tensors, in a plan without speculative decoding
            elif kind == "drafter_expert":
                self.experts.load_drafter(name.split(".")[2], packed, self.room_min_read_tokens is not None)
            else:
                self.drafter.load(name, packed)
                self.weights[name] = self.drafter.weights[name]
            self.progress.advance(packed.nbytes)
        for block in self.moe_blocks + ([self.drafter.layer] if self.drafter else []):
            for matrix, weight in zip(MATRICES, self.experts.slot_weights(block)):
                self.weights[f"blk.{block}.{matrix}.weight"] = weight
        self.experts.write_decode_tables()
        cuda.synchronize()
        self.progress.finish()
        if self.room_min_read_tokens is not None:
            room_bytes = self.experts.n_room * self.model.slot_layout.slot_bytes
            self.progress.note(f"drafter room: {self.experts.n_room} slots ({room_bytes / 2 ** 20:.1f} MiB) lent to "
                               f"the prefill ring ({self.experts.n_ring} slots) by requests that read at least "
                               f"{self.room_min_read_tokens} prompt tokens")

    def _warm_up(self) -> None:
        """Compile every kernel and capture the decode step, and with the drafter a draft step and a verify
        window of each size up to the plan's depth (the end of a request drafts fewer; a GPU compiles in
        seconds, or loads its kernels from the disk cache; the simulator has nothing to compile or capture, so
        it skips the extra passes)."""
        if SIMULATOR:
            return
        self.progress.start("compiling kernels and capturing the decode step", 2 + 2 * bool(self.draft_depth))
        self._prefill([0], 0)
        self.progress.advance()
        self._verify([0], 0)
        self.progress.advance()
        if self.draft_depth:
            self._draft(0, 0, 1)
            self.progress.advance()
            for drafts in range(1, self.draft_depth + 1):
                self._verify([0] * (1 + drafts), 1)
            self.progress.advance()
        self.kv_owner = None
        self.progress.finish()

    # ---------------------------------------------------------------------------------------------------
    # passes

    def _program(self, kind: str, tokens: int):
        """The lowered pass (lowering builds graphs and views, no device memory), kept for the decode step, a
        full chunk and the latest shorter chunk: a prompt's last chunk has any length, and a long-running
        engine would otherwise keep a program for every length it has seen."""
        key = (kind, tokens)
        if key not in self.programs:
            if kind == "prefill" and tokens != self.chunk_tokens:
                for old in [k for k in self.programs if k[0] == "prefill" and k[1] != self.chunk_tokens]:
                    del self.programs[old]
            with_drafter = self.drafter is not None
            graph, arena_bytes, offsets = arena_layout(self.model, kind, tokens, self.kv, with_drafter,
                                                       drafter_kv_rows=self.drafter_kv_pass == "batched")
            region = self.arena.regions["arena"]
            if arena_bytes > region.bytes:
                raise StratumError(f"a {kind} pass of {tokens} tokens needs {arena_bytes} arena bytes; the plan "
                                   f"gives {region.bytes}: the plan was made for another chunk size or draft depth")
            arena = self.arena.memory[region.offset:region.offset + arena_bytes]
            tables = self.experts.prefill_tables if kind == "prefill" else self.experts.decode_tables
            host = {block: self.experts.host_weights(block) for block in self.experts.blocks}
            ring = self.kv_ring
            kv_pages, page_tables = dict(ring.pages), {layer: ring.page_table for layer in ring.pages}
            windows = {}
            if with_drafter:
                drafter = self.drafter.lowering()
                kv_pages.update(drafter["kv_pages"])
                page_tables.update(drafter["page_tables"])
                tables = {**tables, **drafter["expert_slots"]}
                windows = drafter["attention_windows"]
            routed_ids = ({block: self.decode_ids_view[i] for i, block in enumerate(self.moe_blocks)}
                          if kind == "decode" else {})
            self.programs[key] = lower(graph, self.hp, self.weights, kv_pages, page_tables, arena, offsets,
                                       expert_slots=tables, host_experts=host, host_kv=ring.host,
                                       attention_windows=windows, routed_ids=routed_ids,
                                       greedy=None if kind == "prefill" else self.greedy_view)
        return self.programs[key]

    def _inputs(self, program, token_ids, start: int, next_ids=None) -> None:
        """A prompt pass's token ids and positions (and, with the drafter, each row's next token), staged and
        copied in."""
        self._stage(token_ids, start, next_ids)
        self._copy_inputs(program, len(token_ids), self.compute, next_ids is not None)

    def _stage(self, token_ids, start: int, next_ids=None) -> None:
        """A pass's inputs written to pinned staging (every pass ends in a host sync, so the staging is free
        again before the next pass writes it)."""
        n = len(token_ids)
        self.staging[0, :n] = token_ids
        self.staging[1, :n] = np.arange(start, start + n, dtype=np.int32)
        if next_ids is not None:
            self.staging[2, :n] = next_ids

    def _copy_inputs(self, program, n: int, stream, next_ids: bool = False) -> None:
        """The staged inputs' copies (asynchronous; a decode window's and a draft step's are part of their
        captured graphs, so a replay issues them with the kernels in one driver call)."""
        copy_rows(program.tensors["token_ids"], 0, self.staging[0], 0, n, stream)
        copy_rows(program.tensors["positions"], 0, self.staging[1], 0, n, stream)
        if next_ids:
            copy_rows(program.tensors["next_token_ids"], 0, self.staging[2], 0, n, stream)

    def _prefill(self, token_ids, start: int) -> np.ndarray:
        """Read positions start.. in chunks of the plan's size; the last position's logits. With the drafter,
        each chunk stores the drafter's K/V too (row q with the token at q + 1; the last row's is not known
        yet: 0, stored again by the first draft step), and the last position's hidden state is kept for it.
        Only the drafter's positions its window can still reach are stored (the prompt's last window): their
        pages take drafter ring slots, and the store skips rows whose page has none."""
        reach_from = start + len(token_ids) - self.drafter.window_tokens if self.drafter is not None else 0
        batched = self.drafter is not None and self.drafter_kv_pass == "batched"
        for begin in range(0, len(token_ids), self.chunk_tokens):
            piece = token_ids[begin:begin + self.chunk_tokens]
            first, end = start + begin, start + begin + len(piece)
            program = self._program("prefill", len(piece))
            self.kv_ring.claim(first, end, self.compute)
            next_ids = None
            if batched:
                next_ids = list(token_ids[begin + 1:begin + len(piece) + 1])
                next_ids += [0] * (len(piece) - len(next_ids))
                if end > reach_from:
                    self.drafter.ring.claim(max(first, reach_from), end, self.compute)
            self._inputs(program, piece, first, next_ids)
            self._run_prefill(program)
            if end == start + len(token_ids):       # read before the drafter's own pass: it uses the same arena
                if self.drafter is not None:
                    copy_rows(self.hidden, 0, program.tensors["hidden_out"], len(piece) - 1, 1, self.compute)
                # into pinned memory: a copy to a new pageable array costs the host its allocation, and waits
                logits = program.tensors["logits"]
                copy_rows(self.last_logits, 0, logits, logits.shape[0] - 1, 1, self.compute)
            if self.drafter is not None and not batched:
                last_known = start + len(token_ids) - 1     # the last position's row waits for its next token
                rows = range(max(first, reach_from), min(end, last_known))
                if rows:
                    copy_rows(self.prompt_hiddens, 0, program.tensors["hidden_out"], rows.start - first, len(rows),
                              self.compute)
                    self._drafter_rows(token_ids, start, rows)
        self.compute.synchronize()
        return self.last_logits[0].copy()

    def _drafter_rows(self, token_ids, start: int, positions) -> None:
        """The drafter's own pass over a prompt chunk's rows (the A/B switch to the batched one): a draft step at
        each position q, reading the token at q + 1 and the chunk's hidden state at q (`prompt_hiddens`, pinned:
        a draft step's activations take the arena bytes the chunk's pass left them in)."""
        draft = self._program("draft", 1)
        ring, window = self.drafter.ring, self.drafter.window_tokens
        # a step's attention reads its whole window, which reaches back before the first row this pass stores:
        # those pages take slots too, so the kernel never follows a page the ring has no slot for (no host copy
        # behind it), and the ones no pass stored are zeroed (stale bytes could be NaN, and the step's router
        # would pick expert ids from them); later rows' windows reach only pages stored since
        reach = range(max(0, positions[0] - window + 1) // ring.page_tokens, positions[0] // ring.page_tokens + 1)
        unstored = [page % ring.n_slots for page in reach if ring.holds[page % ring.n_slots] != page]
        for i, q in enumerate(positions):
            ring.claim(max(0, q - window + 1), q + 1, self.compute)
            if i == 0:
                ring.clear(unstored, self.compute)
            self._inputs(draft, [token_ids[q - start + 1]], q)
            copy_rows(draft.tensors["hidden_in"], 0, self.prompt_hiddens, i, 1, self.compute)
            # its own graph: a draft step's captures its copies, which read and write `self.hidden`
            self._replay(("drafter rows", 1), draft.run)
            self.compute.synchronize()       # the next row's inputs reuse the staging

    def _run_prefill(self, program) -> None:
        """A chunk's pass. A MoE block that streams experts waits for its routing (the host reads it back to
        work out the ring's batches); a block whose every expert is cached runs without waiting, its routing
        read back for the traces' counts, which the host takes once the whole chunk is launched, each block's as
        soon as its copy is done, while the GPU runs the later blocks (the host's time per wait is the GPU's
        idle time)."""
        unread = []         # (block, its routed ids, the event of their copy) of the cached blocks
        for step in program.steps:
            op = program.graph.nodes[step.name]["op"]
            if op == "moe_down_matmul":
                continue        # run with its gate/up, batch by batch
            if op != "moe_swiglu_matmul":
                step.run(self.compute)
                continue
            block = tensor_layer(step.name)
            down = program.steps.named(f"blk.{block}.moe_down")
            routed = program.tensors[f"blk.{block}.topk"]
            ids = self.routed_ids[self.moe_blocks.index(block), :routed.shape[0]]
            copy_rows(ids, 0, routed, 0, routed.shape[0], self.compute)

            def run_batch(lo, hi, tiles, step=step, down=down):
                step.launch(self.compute, *step.args, lo=lo, hi=hi, tiles=tiles)
                down.launch(self.compute, *down.args, lo=lo, hi=hi, tiles=tiles)
            if self.experts.all_cached(block):
                copied = self.routed_copied[self.moe_blocks.index(block)]
                copied.record(self.compute)
                self.experts.run_cached_block(block, self.compute, run_batch)
                unread.append((block, ids, copied))
                continue
            self.compute.synchronize()
            self.experts.stream_block(block, ids, self.compute, run_batch)
        for block, ids, copied in unread:
            copied.synchronize()
            self.experts.count_routed(block, ids)
        if unread:
            self.compute.synchronize()          # the next chunk's inputs reuse the staging

    def _replay(self, key, enqueue) -> None:
        """Run a pass as its captured graph: the first time it runs as launched (compiling any kernel not yet
        compiled), then it is captured, and later calls replay it."""
        graph = self.graphs.get(key)
        if graph is None:
            enqueue(self.compute)
            self.compute.synchronize()
            self.graphs[key] = CapturedGraph(enqueue, self.compute)
        else:
            graph.replay(self.compute)

    def _enqueue_decode(self, stream, rows: int) -> None:
        """A decode window as captured: its staged inputs in, its kernels (each MoE block's routing writes its ids
        into `decode_ids` for the cache policy, its argmax its greedy tokens into `greedy`), with the drafter its
        hidden states out to pinned memory."""
        program = self._program("decode", rows)
        self._copy_inputs(program, rows, stream)
        program.run(stream)
        if self.drafter is not None:
            copy_rows(self.hiddens, 0, program.tensors["head_norm"], 0, rows, stream)

    def _enqueue_draft(self, stream) -> None:
        """A draft step as captured: its staged inputs and hidden state in, the NextN block (its argmax writes its
        greedy token into `greedy`), its hidden state out."""
        program = self._program("draft", 1)
        self._copy_inputs(program, 1, stream)
        copy_rows(program.tensors["hidden_in"], 0, self.hidden, 0, 1, stream)
        program.run(stream)
        copy_rows(self.hidden, 0, program.tensors["head_norm"], 0, 1, stream)

    def _verify(self, tokens: list, position: int):
        """A decode window of the trunk over `tokens` at positions position..: its greedy tokens land in
        `self.greedy`, its rows' hidden states (with the drafter) in `self.hiddens`; the program (logits)."""
        rows = len(tokens)
        program = self._program("decode", rows)
        self.kv_ring.claim(position, position + rows, self.compute)
        self._stage(tokens, position)
        self._replay(("decode", rows), lambda stream: self._enqueue_decode(stream, rows))
        self.compute.synchronize()
        self.experts.record_decode(self.decode_ids[:, :rows])
        self.experts.after_decode_step(self.compute)
        return program

    def _draft(self, token: int, position: int, depth: int, temperature: float = 0.0) -> tuple:
        """`depth` draft steps from `position` (the drafter's row there reads `token`, the token at position
        + 1, and the hidden state in `self.hidden`); each step proposes the token after the next: its argmax,
        or at a temperature a sample of its distribution. Returns (drafts, their distributions: sampled only)."""
        program = self._program("draft", 1)
        drafts, distributions = [], []
        for q in range(position, position + depth):
            self.drafter.ring.claim(q, q + 1, self.compute)
            self._stage([token], q)
            self._replay(("draft", 1), self._enqueue_draft)
            self.compute.synchronize()
            token = int(self.greedy[0])
            if not 0 <= token < self.hp.n_vocab:     # non-finite drafter logits: propose nothing further
                break
            if temperature > 0:
                distributions.append(probabilities(program.tensors["logits"].copy_to_host()[0], temperature))
                token = int(self.rng.choice(self.hp.n_vocab, p=distributions[-1]))
            drafts.append(token)
        return drafts, distributions

    # ---------------------------------------------------------------------------------------------------
    # requests

    def stream(self, prompt_ids, max_new_tokens: int = 256, temperature: float = 0.0, conversation=None,
               stop_ids=(), logits: list | None = None, draft_depth: int | None = None):
        """Yield new token ids one by one. `logits`, when a list, receives each token's logits (float32);
        draft_depth: tokens the drafter proposes per verify window (default the plan's; 0 turns drafting
        off): greedy output is bitwise the output without drafting, sampled output (temperature > 0) keeps
        its distribution (standard speculative sampling)."""
        prompt = [int(t) for t in prompt_ids]
        self._check_request(prompt, max_new_tokens, temperature)
        depth = self._check_depth(draft_depth)
        owner, self.kv_owner = self.kv_owner, None      # a request stopped part-way leaves no reusable K/V
        reused = 0
        if conversation is not None and owner is not None and owner[0] == conversation:
            prefix = owner[1]
            if prompt[:len(prefix)] == list(prefix):
                reused = min(len(prefix), len(prompt) - 1)
        called = time.perf_counter()
        self.experts.settle(self.compute)
        if self.experts.room_open:      # a request stopped while it read its prompt left the room open
            self.experts.close_room(self.compute)
        self._lend_kv_pages(len(prompt) + max_new_tokens)
        read = len(prompt) - reused
        room = self.room_min_read_tokens is not None and read >= self.room_min_read_tokens
        if room:
            self.experts.open_room()
        row = self._prefill(prompt[reused:], reused)
        if conversation is not None:
            self.kv_owner = (conversation, tuple(prompt))
        lend_s = self.experts.close_room(self.compute) if room else 0.0
        if any(self.experts.free.values()):
            self.experts.refresh(self.compute)      # fills the lent slots while decode reads the host copy
        prefill_s = time.perf_counter() - called
        self.totals.prefill_tokens += read
        self.totals.prefill_s += prefill_s
        self.totals.reused_tokens += reused
        self.totals.requests += 1
        self.totals.prompt_lengths[len(prompt)] = self.totals.prompt_lengths.get(len(prompt), 0) + 1
        self.totals.last = {"prompt_tokens": len(prompt), "reused_tokens": reused, "prefill_s": prefill_s,
                            "room_open": room, "lent_slots": self.experts.stats.lent_slots}
        if room:
            self.experts.stats.room_requests += 1
            self.experts.stats.room_lend_s += lend_s
            self.totals.last["room_lend_s"] = lend_s
            self.progress.note(f"drafter room: read {read} tokens with {self.experts.n_ring + self.experts.n_room} "
                               f"ring slots, given back in {lend_s * 1e3:.1f} ms")
        position, decode_started = len(prompt), time.perf_counter()
        pending = [(self._choose(row, temperature), row)]      # (token, the logits it was chosen from)
        produced = 0
        while pending:
            token, chosen_from = pending.pop(0)
            if logits is not None:
                logits.append(np.asarray(chosen_from, np.float32))
            if produced == 0:
                self.totals.last["first_token_s"] = time.perf_counter() - called
            else:
                self.totals.decode_tokens += 1
            yield token
            produced += 1
            if token in stop_ids or produced == max_new_tokens:
                break
            if pending:
                continue
            n = min(depth, max_new_tokens - produced - 1)
            drafts, draft_probs = self._draft(token, position - 1, n, temperature) if n else ([], [])
            program = self._verify([token] + drafts, position)
            rows = None
            if temperature > 0 or logits is not None:
                rows = program.tensors["logits"].copy_to_host()
            if temperature > 0:
                target = [probabilities(row, temperature) for row in rows[:len(drafts) + 1]]
                accepted, last = speculative_accept(drafts, draft_probs, target, self.rng)
                chosen = drafts[:accepted] + [last]
            else:
                accepted = accepted_drafts(drafts, self.greedy)
                chosen = [int(self.greedy[r]) for r in range(accepted + 1)]
            if drafts:
                self.drafter.record(len(drafts), accepted)
                self.hidden[0] = self.hiddens[accepted]
            pending += [(chosen_token, rows[r] if rows is not None else None) for r, chosen_token in enumerate(chosen)]
            position += accepted + 1
        self.totals.decode_s += time.perf_counter() - decode_started
        self.totals.last["decode_s"] = time.perf_counter() - decode_started

    def _lend_kv_pages(self, request_tokens: int) -> None:
        """Lend the K/V ring's slots a request of `request_tokens` positions cannot reach to the expert cache
        (`planner.kv_lending`), before its passes store K/V (slots it needs again give their experts up)."""
        if not self.kv_lending:
            return
        ring = self.kv_ring
        lent = lent_slots(ring.parts, len(ring.pages), ring.n_slots, request_tokens, ring.page_tokens,
                          self.model.slot_layout.slot_bytes)
        self.experts.lend([self.experts.kv_first + s.slot for s in lent], self.compute)
        ring.lend(int(needed_pages(request_tokens, ring.page_tokens)), self.compute)

    def _check_depth(self, draft_depth: int | None) -> int:
        if draft_depth is None:
            return self.draft_depth
        if draft_depth and self.drafter is None:
            raise StratumError(f"draft_depth {draft_depth}: this engine has no drafter ({self._no_drafter_reason()})")
        if not 0 <= draft_depth <= MAX_DRAFT_DEPTH:
            raise StratumError(f"draft_depth {draft_depth}: 0 (off) to {MAX_DRAFT_DEPTH} (the plan's arena holds "
                               f"verify windows of up to {1 + MAX_DRAFT_DEPTH} rows)")
        return draft_depth

    def generate(self, prompt_ids, max_new_tokens: int = 256, temperature: float = 0.0, conversation=None,
                 stop_ids=(), return_logits: bool = False, draft_depth: int | None = None) -> Generation:
        rows = [] if return_logits else None
        tokens = list(self.stream(prompt_ids, max_new_tokens, temperature, conversation, stop_ids, rows, draft_depth))
        last = self.totals.last
        return Generation(tokens, np.stack(rows) if rows else None, last["prompt_tokens"], last["reused_tokens"],
                          last["prefill_s"], last.get("decode_s", 0.0), last.get("first_token_s", 0.0))

    def _check_request(self, prompt: list, max_new_tokens: int, temperature: float) -> None:
        if not prompt:
            raise StratumError("the prompt is empty: a request needs at least one token")
        bad = [t for t in prompt if not 0 <= t < self.hp.n_vocab]
        if bad:
            raise StratumError(f"token id {bad[0]} is outside the vocabulary (0..{self.hp.n_vocab - 1})")
        if max_new_tokens < 1 or temperature < 0:
            raise StratumError("max_new_tokens must be >= 1 and temperature >= 0")
        if len(prompt) + max_new_tokens > self.max_tokens:
            raise StratumError(f"{len(prompt)} prompt + {max_new_tokens} new tokens exceed the plan's context of "
                               f"{self.max_tokens} positions: plan for a longer context or ask for fewer tokens")

    def _choose(self, row, temperature: float) -> int:
        """The first token, from the prompt's last logits: greedy, or a sample at `temperature`."""
        if temperature == 0:
            return int(np.argmax(row))
        return int(self.rng.choice(len(row), p=probabilities(row, temperature)))

    # ---------------------------------------------------------------------------------------------------
    # reporting and lifetime

    def stats(self) -> dict:
        t, e = self.totals, self.experts.stats
        return {"startup_s": round(self.startup_s, 3), "requests": t.requests,
                "prefill_tokens": t.prefill_tokens, "prefill_tok_s": _rate(t.prefill_tokens, t.prefill_s),
                "decode_tokens": t.decode_tokens, "decode_tok_s": _rate(t.decode_tokens, t.decode_s),
                "reused_tokens": t.reused_tokens, "expert_cache_hit_rate": round(e.hit_rate, 4),
                "expert_bytes_copied": e.streamed_bytes, "experts_refreshed": e.refreshed_experts,
                "room_requests": e.room_requests, "room_lend_s": round(e.room_lend_s, 4),
                "expert_slots_lent": e.lent_slots,
                "device_bytes": self.arena.nbytes, "kernels": kernel_counts(), **self._draft_stats(),
                "last_request": dict(t.last)}

    @staticmethod
    def _traced_popularity(settings: dict):
        """The routing counts the plan was solved from (a traced workload's histogram), or None."""
        histogram = settings["workload"].get("expert_popularity", {}).get("histogram")
        return histogram if isinstance(histogram, list) else None

    def trace(self) -> dict:
        """The requests served so far as a workload document (`planner.workload`): their prompt lengths, tokens
        generated, reused prefix, draft acceptance, and every MoE block's routing counts (prefill and decode),
        the histogram the planner's hit-rate curve reads (`stratum plan --workload`)."""
        t = self.totals
        if not t.requests:
            raise StratumError("no request has run yet: a trace describes the requests an engine served")
        prompt_tokens = sum(tokens * n for tokens, n in t.prompt_lengths.items())
        doc = {"prompts": [{"tokens": tokens, "weight": n} for tokens, n in sorted(t.prompt_lengths.items())],
               "decode_tokens": round((t.decode_tokens + t.requests) / t.requests),
               "reused_prefix": round(min(t.reused_tokens / prompt_tokens, 0.999), 4)}
        if self.drafter is not None:
            doc["drafter_window"] = self.drafter.window_tokens
            if self.drafter.stats.drafted:
                doc["draft_acceptance"] = round(min(self.drafter.stats.acceptance, 0.999), 4)
        doc["expert_popularity"] = {"histogram": self.experts.routed.tolist()}
        return doc

    def _draft_stats(self) -> dict:
        if self.drafter is None:
            return {}
        d = self.drafter.stats
        return {"draft_windows": d.windows, "drafted_tokens": d.drafted, "accepted_drafts": d.accepted,
                "draft_acceptance": round(d.acceptance, 4)}

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.close()
        self.graphs.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _rate(tokens: int, seconds: float) -> float:
    return round(tokens / seconds, 2) if seconds > 0 else 0.0
