"""`stratum`: plan, inspect and compare VRAM layouts; run a plan (`run`, `bench`: runtime.commands).

Bad input ends in one line naming the file and the field, and exit code 2; never a traceback.
"""

import argparse
import sys
import time
from pathlib import Path

from planner.errors import StratumError


def _add_plan_arguments(p: argparse.ArgumentParser):
    p.add_argument("--hardware", required=True, help="bundled profile name (see `stratum profiles`) or a profile YAML")
    p.add_argument("--model", required=True, help="a GGUF file (its header is enough), a model card YAML, or a "
                   "bundled card name (see `stratum models`)")
    p.add_argument("--context", type=int, help="positions per conversation (default: the model's, at most 32768)")
    p.add_argument("--kv", default="f16", help="K/V type: f16, q8_0, q4_0, ... or a mix such as k8v4 (default f16)")
    mtp = p.add_mutually_exclusive_group()
    mtp.add_argument("--mtp", dest="mtp", action="store_true", default=None,
                     help="draft with the model's NextN block (default when it has one)")
    mtp.add_argument("--no-mtp", dest="mtp", action="store_false", help="no speculative drafting")
    w = p.add_argument_group("workload (flags override --workload)")
    w.add_argument("--workload", help="workload YAML (see planner/workload.py for the fields)")
    w.add_argument("--prompt-tokens", type=int, nargs="+", help="prompt lengths to optimise for, equally weighted")
    w.add_argument("--decode-tokens", type=int, help="tokens generated per request (default 256)")
    w.add_argument("--acceptance", type=float, help="chance each draft token is accepted (default 0.7)")
    w.add_argument("--reuse", type=float, help="fraction of each prompt that is a reused prefix (default 0)")
    w.add_argument("--skew", type=float, help="Zipf exponent of expert popularity (default 1.0)")
    k = p.add_argument_group("pins (hold a knob fixed; the rest is solved around it)")
    k.add_argument("--chunk", type=int, help="prefill chunk tokens")
    k.add_argument("--kv-pages", type=int, help="K/V ring pages")
    k.add_argument("--ring-slots", type=int, help="prefill ring slots")


def _workload(args):
    from dataclasses import replace

    from planner.workload import Workload, load_workload, parse_workload

    workload = load_workload(args.workload) if args.workload else Workload()
    overrides = {}
    if args.prompt_tokens:
        overrides["prompts"] = [{"tokens": t} for t in args.prompt_tokens]
    for flag, key in (("decode_tokens", "decode_tokens"), ("acceptance", "draft_acceptance"),
                      ("reuse", "reused_prefix")):
        if getattr(args, flag) is not None:
            overrides[key] = getattr(args, flag)
    if args.skew is not None:
        overrides["expert_popularity"] = {"skew": args.skew}
    if not overrides:
        return workload
    checked = parse_workload(overrides, source="command line")     # the same checks as a file's fields
    fields = {"skew" if key == "expert_popularity" else key: None for key in overrides}
    if "skew" in fields:
        fields["histogram"] = None      # a skew given on the command line replaces a measured histogram
    return replace(workload, **{key: getattr(checked, key) for key in fields})


def cmd_plan(args):
    from planner.search import solve

    pins = {key: value for key, value in (("chunk_tokens", args.chunk), ("kv_pages", args.kv_pages),
                                          ("ring_slots", args.ring_slots)) if value is not None}
    plan = solve(hardware=args.hardware, model=args.model, context=args.context, kv=args.kv, mtp=args.mtp,
                 workload=_workload(args), pins=pins)
    if args.output:
        plan.save(args.output)
        print(f"wrote {args.output}", file=sys.stderr)
    if args.json:
        print(plan.to_json())
    elif not args.output:
        from planner import report

        print(report.show(plan, color=sys.stdout.isatty()))


def cmd_show(args):
    from planner import report
    from planner.plan import load_plan

    plan = load_plan(args.plan, model=args.model, hardware=args.hardware)
    if args.svg:
        Path(args.svg).write_text(report.svg(plan))
        print(f"wrote {args.svg}", file=sys.stderr)
    else:
        print(report.show(plan, color=sys.stdout.isatty()))


def cmd_explain(args):
    from planner import report
    from planner.plan import load_plan

    print(report.explain(load_plan(args.plan, model=args.model, hardware=args.hardware)))


def cmd_diff(args):
    from planner import report
    from planner.plan import load_plan

    print(report.diff(load_plan(args.a), load_plan(args.b)))


def cmd_generate(args):
    from planner.generate import generate

    from plans import GENERATED_DIR

    out = Path(args.out) if args.out else GENERATED_DIR
    written = generate(out, progress=lambda what: print(f"  solving {what}", file=sys.stderr))
    print(f"wrote {len(written)} files under {out}")


def cmd_profiles(args):
    from planner.profile import bundled_profiles, load_profile
    from planner.units import format_bytes, format_rate

    for name in bundled_profiles():
        profile = load_profile(name)
        for gpu in profile.gpus:
            print(f"{name:20} {gpu.name:34} {format_bytes(gpu.vram_bytes):>10} "
                  f"{format_rate(gpu.memory_bandwidth_bytes_per_s):>11} VRAM  "
                  f"{format_rate(gpu.host_to_device_bytes_per_s):>9} host link")


def cmd_profile(args):
    if not args.detect:
        raise StratumError("stratum profile writes this machine's hardware profile: give --detect (it measures "
                           "the GPU for a few minutes)")
    from runtime.detect import detect
    detect(Path(args.output), name=args.name, calibrate=not args.no_calibrate,
           samples=Path(args.samples) if args.samples else None)


def cmd_models(args):
    from planner.model import bundled_cards, load_model
    from planner.units import format_bytes

    for name in bundled_cards():
        model = load_model(name)
        hp = model.hparams
        print(f"{name:26} {hp.architecture:9} {hp.n_trunk:3} blocks {hp.n_expert:4} experts "
              f"{format_bytes(model.total_bytes):>11} total {format_bytes(model.dense_bytes):>10} dense"
              f"{'  + MTP drafter' if model.has_drafter else ''}")


def cmd_run(args):
    args.started = time.perf_counter()      # before numba's import: the first token's time is from here
    from runtime.commands import run
    run(args)


def cmd_bench(args):
    from runtime.commands import bench
    bench(args)


def cmd_trace(args):
    from runtime.commands import trace
    trace(args)


def _add_engine_arguments(sub):
    p = sub.add_parser("run", help="run a model on this machine's GPU: prompt token ids (or text) in, new ones out")
    p.add_argument("--plan", help="a plan YAML (`stratum plan -o`); default: one solved for --hardware, for a "
                   "context of the prompt and --max-new-tokens")
    p.add_argument("--hardware", help="the profile to solve a plan for when --plan is not given (default: the "
                   "bundled profile of this machine's GPU); with --plan, refuse a plan made for other hardware")
    p.add_argument("--model", required=True, help="the GGUF file (the one the plan was made for)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", help="prompt token ids, e.g. 1,2,3; the new ids are printed")
    prompt.add_argument("--prompt", help="prompt text, for a model with a byte-level vocabulary (UTF-8 bytes are "
                        "its token ids); the new text is printed")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--stop-ids", type=int, nargs="*", help="stop after generating one of these ids")
    p.add_argument("--seed", type=int, help="sampling seed")
    p.add_argument("--draft-depth", type=int, help="MTP drafts per verify window (default the plan's; 0: off)")
    p.add_argument("--quiet", action="store_true", help="no progress lines at start")
    p.set_defaults(run=cmd_run)
    p = sub.add_parser("bench", help="measured prefill and decode tok/s beside the plan's predictions")
    p.add_argument("--plan", required=True, help="a plan YAML (`stratum plan -o`)")
    p.add_argument("--model", required=True, help="the GGUF file the plan was made for")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[512], help="prompt lengths (random ids)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request")
    p.add_argument("--repeats", type=int, default=3, help="requests per prompt length (the median is shown)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-depth", type=int, help="MTP drafts per verify window (default the plan's; 0: off)")
    p.add_argument("--quiet", action="store_true", help="no progress lines at start")
    p.set_defaults(run=cmd_bench)
    p = sub.add_parser("trace", help="serve a file's prompts and write them as a workload (lengths, expert popularity)")
    p.add_argument("--model", required=True, help="the GGUF file")
    p.add_argument("--plan", help="a plan YAML; default: one solved for --hardware, for the longest prompt")
    p.add_argument("--hardware", help="the profile to solve a plan for (default: this machine's GPU's bundled one)")
    p.add_argument("--prompts", required=True, help="a file of prompts, one a line: token ids (or text with --text)")
    p.add_argument("--text", action="store_true", help="the prompts are text, for a byte-level vocabulary")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("-o", "--output", required=True, help="the workload YAML to write")
    p.add_argument("--quiet", action="store_true", help="no progress lines at start")
    p.set_defaults(run=cmd_trace)


def _add_check_arguments(p: argparse.ArgumentParser):
    p.add_argument("--model", help="refuse the plan unless it was made for this model (GGUF, card or name)")
    p.add_argument("--hardware", help="refuse the plan unless it was made for this hardware profile")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stratum", description="Plan MoE inference on GPUs too small for the model.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="solve a VRAM plan for a model on a hardware profile")
    _add_plan_arguments(p)
    p.add_argument("-o", "--output", help="write the plan (YAML, or JSON if the name ends in .json)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=cmd_plan)
    p = sub.add_parser("show", help="the layout as a table and a bar per GPU, the knobs, the predictions")
    p.add_argument("plan")
    p.add_argument("--svg", help="write the layout as an SVG picture instead")
    _add_check_arguments(p)
    p.set_defaults(run=cmd_show)
    p = sub.add_parser("explain", help="why each knob has its value, and what binds")
    p.add_argument("plan")
    _add_check_arguments(p)
    p.set_defaults(run=cmd_explain)
    p = sub.add_parser("diff", help="what changed between two plans, region by region")
    p.add_argument("a")
    p.add_argument("b")
    p.set_defaults(run=cmd_diff)
    p = sub.add_parser("generate", help="plans/generated/<profile>/<card>.yaml for every bundled pair")
    p.add_argument("--out", help="folder to write to (default: the bundled plans/generated)")
    p.set_defaults(run=cmd_generate)
    sub.add_parser("profiles", help="the bundled hardware profiles").set_defaults(run=cmd_profiles)
    sub.add_parser("models", help="the bundled model cards").set_defaults(run=cmd_models)
    p = sub.add_parser("profile", help="measure this machine's GPU and write its hardware profile")
    p.add_argument("--detect", action="store_true", help="measure memory, bandwidths, links, launch costs and "
                   "this project's kernels on GPU 0")
    p.add_argument("-o", "--output", default="profile.yaml", help="the profile to write (default: profile.yaml)")
    p.add_argument("--name", help="the profile's name (default: the file's stem)")
    p.add_argument("--no-calibrate", action="store_true", help="skip the kernel calibration (its two minutes)")
    p.add_argument("--samples", help="also write the calibration's timed nodes to this JSON file")
    p.set_defaults(run=cmd_profile)
    _add_engine_arguments(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except StratumError as err:
        print(f"stratum: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
