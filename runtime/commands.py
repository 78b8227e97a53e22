"""`stratum run` and `stratum bench`: the engine from the command line (`run` solves a plan for this machine
when it is given none). planner.cli defines their arguments and imports this module only when one of them
runs, so planning never imports numba."""

import sys
import time

import numpy as np

from codegen.lower.cuda import available, device_name, kernel_counts
from planner import vocab
from planner.errors import StratumError
from planner.header import read_header
from planner.plan import load_plan
from planner.profile import profile_for_gpu
from planner.search import MIN_CHUNK_TOKENS, solve
from runtime.engine import Engine


def parse_ids(text: str) -> list:
    try:
        ids = [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise StratumError(f"--prompt-ids takes token ids separated by commas or spaces, not {text!r}") from None
    if not ids:
        raise StratumError("--prompt-ids is empty")
    return ids


def prompt_ids(args) -> list:
    """The prompt's token ids: --prompt-ids as given, or --prompt's UTF-8 bytes for a byte-level vocabulary."""
    if args.prompt is None:
        return parse_ids(args.prompt_ids)
    tokenizer = read_header(args.model).metadata.get(vocab.TOKENIZER_MODEL_KEY)
    if tokenizer != vocab.BYTE_TOKENIZER:
        raise StratumError(f"--prompt needs a byte-level vocabulary ({vocab.TOKENIZER_MODEL_KEY} "
                           f"{vocab.BYTE_TOKENIZER!r}), this model's is {tokenizer!r}: give --prompt-ids",
                           source=args.model)
    return vocab.encode(args.prompt)


def run_plan(args, prompt_tokens: int):
    """--plan (refused if made for other hardware than a --hardware given), else a plan solved for --hardware
    (else this GPU's bundled profile) whose context holds the prompt and the new tokens."""
    if args.plan:
        return load_plan(args.plan, hardware=args.hardware)
    if not args.hardware and not available():
        raise StratumError("no CUDA GPU found: there is nothing to run on")
    hardware = args.hardware or profile_for_gpu(device_name())
    context = max(prompt_tokens + args.max_new_tokens, 2 * MIN_CHUNK_TOKENS)
    plan = solve(hardware=hardware, model=args.model, context=context)
    if not args.quiet:
        print(f"plan: solved for {hardware}, a context of {context} positions", file=sys.stderr)
    return plan


def run(args) -> None:
    prompt = prompt_ids(args)
    plan = run_plan(args, len(prompt))
    with Engine(plan, args.model, progress=not args.quiet, seed=args.seed) as engine:
        stop = set(args.stop_ids or ())
        decoder = vocab.text_decoder() if args.prompt is not None else None
        first_token_s = None
        for token in engine.stream(prompt, args.max_new_tokens, args.temperature, stop_ids=stop,
                                   draft_depth=args.draft_depth):
            if first_token_s is None:
                first_token_s = time.perf_counter() - args.started
            if decoder:
                print(decoder.decode(bytes([token])), end="", flush=True)
            else:
                print(token, end=" ", flush=True)
        print(decoder.decode(b"", final=True) if decoder else "")
        _print_stats(engine.stats())
        kernels = ", ".join(f"{n} {how}" for how, n in kernel_counts().items() if n) or "none launched"
        print(f"first token {first_token_s:.2f} s after the command started (engine start {engine.startup_s:.2f} s: "
              f"weights, kernels ({kernels}), decode step captured)", file=sys.stderr)


def bench(args) -> None:
    """Random prompts of the given lengths; measured prefill and decode tok/s beside the plan's predictions."""
    plan = load_plan(args.plan)
    rng = np.random.default_rng(args.seed)
    predicted_prefill = {p["prompt_tokens"]: p["tok_s"] for p in plan.predictions.get("prefill", [])}
    predicted_decode = plan.predictions.get("decode", [])
    with Engine(plan, args.model, progress=not args.quiet, seed=args.seed) as engine:
        drafting = engine.draft_depth if args.draft_depth is None else args.draft_depth
        # the plan predicts decode without drafting and at its own draft depth (no other)
        predicted_key = ("tok_s_without_mtp" if not drafting
                         else "tok_s" if drafting == plan.knobs.get("draft_depth") else None)
        vocab = engine.hp.n_vocab
        print(f"{'prompt':>8} {'prefill tok/s':>14} {'predicted':>10} {'decode tok/s':>13} {'predicted':>10}")
        for tokens in args.prompt_tokens:
            prefill, decode = [], []
            for _ in range(args.repeats):
                out = engine.generate(rng.integers(0, vocab, size=tokens).tolist(), args.new_tokens,
                                      draft_depth=args.draft_depth)
                prefill.append(tokens / out.prefill_s)
                if len(out.tokens) > 1:
                    decode.append((len(out.tokens) - 1) / out.decode_s)
            depth = min(predicted_decode, key=lambda d: abs(d["depth"] - tokens), default=None)
            print(f"{tokens:>8} {np.median(prefill):>14.1f} {_fmt(predicted_prefill.get(tokens)):>10} "
                  f"{np.median(decode) if decode else 0:>13.2f} {_fmt(depth and depth.get(predicted_key)):>10}")
        _print_stats(engine.stats())


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _print_stats(stats: dict) -> None:
    last = stats.pop("last_request")
    print("stats: " + ", ".join(f"{k} {v}" for k, v in stats.items()), file=sys.stderr)
    if last:
        print("last request: " + ", ".join(f"{k} {round(v, 4) if isinstance(v, float) else v}"
                                           for k, v in last.items()), file=sys.stderr)
