"""`stratum run`, `stratum bench` and `stratum trace`: the engine from the command line (`run` and `trace` solve a
plan for this machine when they are given none). planner.cli defines their arguments and imports this module
only when one of them runs, so planning never imports numba."""

import sys
import time
from pathlib import Path

import numpy as np
import yaml

from codegen.lower.cuda import available, device_name, kernel_counts
from planner import vocab
from planner.errors import StratumError
from planner.header import read_header
from planner.plan import load_plan
from planner.profile import profile_for_gpu
from planner.search import MIN_CHUNK_TOKENS, solve
from runtime.engine import Engine
from runtime.synthetic import counts_top_quarter_share


def parse_ids(text: str, option: str = "--prompt-ids") -> list:
    try:
        ids = [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise StratumError(f"{option} takes token ids separated by commas or spaces, not {text!r}") from None
    if not ids:
        raise StratumError(f"{option} is empty")
    return ids


def prompt_ids(args) -> list:
    """The prompt's token ids: --prompt-ids as given, or --prompt's UTF-8 bytes for a byte-level vocabulary."""
    if args.prompt is None:
        return parse_ids(args.prompt_ids)
    check_byte_vocabulary(args.model, "--prompt", "give --prompt-ids")
    return vocab.encode(args.prompt)


def check_byte_vocabulary(model, option: str, instead: str) -> None:
    tokenizer = read_header(model).metadata.get(vocab.TOKENIZER_MODEL_KEY)
    if tokenizer != vocab.BYTE_TOKENIZER:
        raise StratumError(f"{option} needs a byte-level vocabulary ({vocab.TOKENIZER_MODEL_KEY} "
                           f"{vocab.BYTE_TOKENIZER!r}), this model's is {tokenizer!r}: {instead}", source=model)


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


def trace_prompts(args) -> list:
    """The prompts file's lines: token ids, or (--text) UTF-8 text for a byte-level vocabulary; blank lines skipped."""
    try:
        lines = [line for line in Path(args.prompts).read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as error:
        raise StratumError(f"cannot read the prompts: {error.strerror}", source=args.prompts) from None
    if not lines:
        raise StratumError("the prompts file has no prompt", source=args.prompts)
    if args.text:
        check_byte_vocabulary(args.model, "--text", "write token ids, one prompt a line")
        return [vocab.encode(line) for line in lines]
    return [parse_ids(line, "--prompts") for line in lines]


def trace(args) -> None:
    """Serve a file's prompts and write what they did as a workload file (`Engine.trace`): the planner then plans
    for these requests' lengths and these experts' popularity (`stratum plan --workload`)."""
    prompts = trace_prompts(args)
    plan = run_plan(args, max(len(prompt) for prompt in prompts))
    with Engine(plan, args.model, progress=not args.quiet) as engine:
        for prompt in prompts:
            engine.generate(prompt, args.max_new_tokens)
        document = engine.trace()
        stats = engine.stats()
    with open(args.output, "w", encoding="utf-8") as out:
        yaml.safe_dump(document, out, sort_keys=False, default_flow_style=None)
    histogram = np.asarray(document["expert_popularity"]["histogram"])
    print(f"wrote {args.output}: {len(prompts)} prompts, {int(histogram.sum())} expert routings over "
          f"{histogram.shape[0]} MoE blocks (the top quarter of each block's experts took "
          f"{counts_top_quarter_share(histogram):.0%}), decode hit rate {stats['expert_cache_hit_rate']:.0%}",
          file=sys.stderr)


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
