"""Plans as people read them: a terminal summary, an SVG picture, the reasons behind each knob, and a diff.

Pure functions from Plan objects to text; the CLI decides where the text goes. Terminal text comes without
a trailing newline (print adds one); the SVG ends with one, as a file should.
"""

import textwrap
from collections.abc import Collection
from xml.sax.saxutils import escape, quoteattr

from planner.layout import REGION_ORDER, REGION_PURPOSE
from planner.plan import Plan
from planner.units import format_bytes

BAR_WIDTH = 72
TEXT_WIDTH = 100

# One symbol per region, plus the host page tables, free and reserved: first letters where they are unique, case marking the
# drafter's own regions, so a bar reads without its legend once the letters are familiar.
SYMBOL = {"dense": "D", "drafter_dense": "d", "drafter_experts": "e", "kv_ring": "K", "drafter_kv": "k",
          "expert_cache": "E", "prefill_ring": "P", "arena": "A", "tables": "T", "host_page_tables": "h",
          "free": ".", "reserved": "#"}
ANSI = {"dense": "97;44", "drafter_dense": "97;45", "drafter_experts": "30;105", "kv_ring": "30;42",
        "drafter_kv": "30;102", "expert_cache": "30;43", "prefill_ring": "30;46", "arena": "97;41",
        "tables": "30;103", "host_page_tables": "30;101", "free": "30;47", "reserved": "97;100"}
COLOR = {"dense": "#4e79a7", "drafter_dense": "#b07aa1", "drafter_experts": "#d4a6c8", "kv_ring": "#59a14f",
         "drafter_kv": "#8cd17d", "expert_cache": "#f28e2b", "prefill_ring": "#76b7b2", "arena": "#e15759",
         "tables": "#edc948", "host_page_tables": "#ff9d9a", "reserved": "#9d9d9d"}
EXTRA = ("host_page_tables", "free", "reserved")      # after the regions, in bar order
EXTRA_PURPOSE = {"host_page_tables": "the driver's page tables mapping the pinned host copies (beside the arena)",
                 "free": "usable VRAM no region takes", "reserved": "held by the driver, the CUDA context and "
                 "the display: never given to the plan"}


# --- shared formatting -----------------------------------------------------------------------------

def _bytes(n: int) -> str:
    return f"{format_bytes(n)} ({n} B)"


def _number(x) -> str:
    # Predictions are stored at four significant digits; print them as stored, without trailing zeros.
    return f"{x:g}" if isinstance(x, float) else str(x)


def _value(key: str, value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(_value("", v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {_value(k, v)}" for k, v in value.items())
    if any(part.endswith("_bytes") for part in key.split(".")) and isinstance(value, int):
        return _bytes(value)
    return _number(value)


def _percent_change(a: float, b: float) -> str:
    return f"{(b - a) / a:+.1%}" if a else "from zero"


def _table(headers: list[str], rows: list[list[str]], right: Collection[int] = ()) -> list[str]:
    """Columns as wide as their widest cell; the columns in `right` (numbers) aligned right."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return [line(headers)] + [line(row) for row in rows]


def _indent(lines: list[str], prefix: str = "  ") -> list[str]:
    return [prefix + line for line in lines]


def _wrapped(text: str, first: str, rest: str) -> list[str]:
    return textwrap.wrap(text, TEXT_WIDTH, initial_indent=first, subsequent_indent=rest,
                         break_on_hyphens=False) or [first.rstrip()]


def _profile_name(plan: Plan) -> str:
    # A plan file need only carry the profile's fingerprint; the name is for people.
    return plan.profile.get("name", plan.profile["fingerprint"])


def _title(plan: Plan) -> str:
    return f"{plan.model['name']} on {_profile_name(plan)}"


def _settings_line(plan: Plan) -> str:
    s = plan.settings
    return (f"context {s.get('context_tokens')} tokens, kv {s.get('kv')}, "
            f"MTP {'on' if s.get('mtp') else 'off'}")


def _blocks(device: dict) -> str:
    first, end = device["blocks"]     # stored half-open, [first, end)
    return f"{first}-{end - 1}"


def _gpu_line(device: dict) -> str:
    drafter = ", holds the drafter" if device.get("holds_drafter") else ""
    return (f"GPU {device['index']}: {device['gpu']}, {format_bytes(device['vram_bytes'])} VRAM, "
            f"blocks {_blocks(device)}{drafter}")


# --- show ------------------------------------------------------------------------------------------

def _segments(device: dict) -> list[tuple[str, int]]:
    """The device's VRAM in bar order: its regions by offset, then the host page tables, what is free, and the
    reserve."""
    regions = sorted(device["regions"], key=lambda r: r["offset"])
    return [(r["name"], r["bytes"]) for r in regions] + [(name, device[f"{name}_bytes"]) for name in EXTRA]


def _apportion(sizes: list[int], width: int) -> list[int]:
    """Largest-remainder rounding: the counts add up to `width` and each is its exact share rounded down or
    up, so a region smaller than one character may vanish but no region is ever off by more than one."""
    total = sum(sizes)
    counts = [size * width // total for size in sizes]
    remainders = sorted(range(len(sizes)), key=lambda i: sizes[i] * width % total, reverse=True)
    for i in remainders[:width - sum(counts)]:
        counts[i] += 1
    return counts


def _paint(name: str, text: str, color: bool) -> str:
    return f"\x1b[{ANSI[name]}m{text}\x1b[0m" if color and text else text


def _bar(device: dict, color: bool) -> list[str]:
    segments = [(name, size) for name, size in _segments(device) if size]
    counts = _apportion([size for _, size in segments], BAR_WIDTH)
    bar = "".join(_paint(name, SYMBOL[name] * n, color) for (name, _), n in zip(segments, counts))
    legend = "  ".join(f"{_paint(name, SYMBOL[name], color)} {name}" for name, _ in segments)
    return [f"|{bar}|", legend]


def _device_section(device: dict, color: bool) -> list[str]:
    usable = device["usable_bytes"]
    rows = [[r["name"], str(r["offset"]), format_bytes(r["bytes"]), str(r["bytes"]),
             f"{r['bytes'] / usable:.1%}", r.get("purpose", REGION_PURPOSE.get(r["name"], ""))]
            for r in device["regions"]]
    table = _table(["region", "offset", "size", "bytes", "of usable", "purpose"], rows, right={1, 2, 3, 4})
    return ([_gpu_line(device)]
            + _indent(table)
            + _indent([f"reserved {_bytes(device['reserved_bytes'])}; usable {_bytes(usable)}; host page tables "
                       f"{_bytes(device['host_page_tables_bytes'])}; free {_bytes(device['free_bytes'])}"])
            + _indent(_bar(device, color)))


def _knob_section(knobs: dict) -> list[str]:
    return ["Knobs:"] + _indent(_table(["knob", "value"], [[k, _value(k, v)] for k, v in knobs.items()]))


def _prediction_section(predictions: dict) -> list[str]:
    prefill = [[str(p["prompt_tokens"]), str(p["read_tokens"]), _number(p["seconds"]), _number(p["tok_s"]),
                _value("", p["room_open"])] for p in predictions.get("prefill", [])]
    decode = [[str(d["depth"]), _number(d["tok_s"]), _number(d["tok_s_without_mtp"]), str(d["best_draft_depth"])]
              for d in predictions.get("decode", [])]
    return (["Prefill:"]
            + _indent(_table(["prompt tokens", "read tokens", "seconds", "tok/s", "room open"], prefill,
                             right={0, 1, 2, 3}))
            + ["Decode:"]
            + _indent(_table(["depth", "tok/s", "tok/s without MTP", "best draft depth there"], decode,
                             right={0, 1, 2, 3}))
            + _unrated_note(predictions.get("unrated_decode_types"))
            + [f"Expert cache hit rate (decode, by bytes): {predictions.get('expert_hit_rate', 0):.1%}",
               f"Expected request: {_number(predictions.get('request_seconds'))} s"])


def _unrated_note(types) -> list[str]:
    if not types:
        return []
    return _wrapped(f"Decode reads {', '.join(types)} priced at Q8_0's rate: the profile has no decode_weight_rates "
                    "for them (stratum profile --detect measures them), and 4-bit types read slower than their "
                    "bytes, so expect slower decode than this.", "  ", "  ")


def _binding_section(plan: Plan) -> list[str]:
    lines = ["What binds:"]
    for sentence in plan.binding:
        lines += _wrapped(sentence, "  - ", "    ")
    return lines


def show(plan: Plan, color: bool = False) -> str:
    """The whole plan for a terminal: layout per GPU with a bar, knobs, predictions and what binds."""
    summary = plan.model.get("summary", {})
    architecture = f" ({summary['architecture']})" if "architecture" in summary else ""
    lines = [f"model {plan.model['name']}{architecture}, profile {_profile_name(plan)}",
             _settings_line(plan), ""]
    for device in plan.devices:
        lines += _device_section(device, color) + [""]
    lines += _knob_section(plan.knobs) + [""]
    lines += _prediction_section(plan.predictions) + [""]
    lines += _binding_section(plan)
    return "\n".join(lines)


# --- svg -------------------------------------------------------------------------------------------

SVG_WIDTH, MARGIN, BANDS_TOP, BAND_HEIGHT, BAND_GAP, ROW_HEIGHT = 1000, 20, 86, 48, 36, 20
CHAR_PX = 6.6       # a rough width of one character of the 11 px sans-serif labels


def _attrs(**values) -> str:
    """Keyword arguments as XML attributes: `class_` is `class`, `data_name` is `data-name`."""
    return " ".join(f"{key.rstrip('_').replace('_', '-')}={quoteattr(str(v))}" for key, v in values.items())


def _rect(x: float, y: float, width: float, name: str, css: str, title: str, fill: str, **extra) -> str:
    return (f"<rect {_attrs(class_=css, data_name=name, **extra)} x=\"{x:.3f}\" y=\"{y}\" "
            f"width=\"{width:.3f}\" height=\"{BAND_HEIGHT}\" fill=\"{fill}\" stroke=\"#ffffff\" "
            f"stroke-width=\"0.5\"><title>{escape(title)}</title></rect>")


def _label(x: float, y: float, width: float, name: str, size: int) -> list[str]:
    """Name and size inside a rect, only when both fit: a clipped label misleads more than none."""
    text = format_bytes(size)
    if width < max(len(name), len(text)) * CHAR_PX + 6:
        return []
    middle = x + width / 2
    return [f"<text x=\"{middle:.1f}\" y=\"{y + 20}\" text-anchor=\"middle\" font-size=\"11\">{escape(name)}</text>",
            f"<text x=\"{middle:.1f}\" y=\"{y + 34}\" text-anchor=\"middle\" font-size=\"11\">{escape(text)}</text>"]


def _band(device: dict, y: int, scale: float) -> list[str]:
    """One GPU as a band: regions at their offsets, then the host page tables, the free part and the reserve,
    all to scale."""
    index = device["index"]
    parts = [f"<text x=\"{MARGIN}\" y=\"{y - 8}\" font-size=\"12\" font-weight=\"bold\">"
             f"{escape(_gpu_line(device))}</text>"]
    for r in device["regions"]:
        x, width = MARGIN + r["offset"] * scale, r["bytes"] * scale
        title = f"GPU {index} {r['name']}: {_bytes(r['bytes'])} at offset {r['offset']}"
        parts.append(_rect(x, y, width, r["name"], "region", title, COLOR[r["name"]],
                           data_device=index, data_bytes=r["bytes"]))
        parts += _label(x, y, width, r["name"], r["bytes"])
    page_tables = device["host_page_tables_bytes"]
    extras = [("host_page_tables", device["used_bytes"] - page_tables, page_tables, COLOR["host_page_tables"]),
              ("free", device["used_bytes"], device["free_bytes"], "url(#free)"),
              ("reserved", device["usable_bytes"], device["reserved_bytes"], COLOR["reserved"])]
    for name, start, size, fill in extras:
        if name == "host_page_tables" and not size:
            continue
        x, width = MARGIN + start * scale, size * scale
        parts.append(_rect(x, y, width, name, name, f"GPU {index} {name}: {_bytes(size)}", fill,
                           data_device=index, data_bytes=size))
        parts += _label(x, y, width, name, size)
    return parts


def _legend_sizes(plan: Plan) -> dict[str, list[str]]:
    """Every region once, in carving order, with its size on each GPU that has it: sizes differ between GPUs."""
    sizes: dict[str, list[str]] = {}
    for device in plan.devices:
        prefix = f"GPU {device['index']} " if len(plan.devices) > 1 else ""
        for r in device["regions"]:
            sizes.setdefault(r["name"], []).append(prefix + format_bytes(r["bytes"]))
        for name in EXTRA:
            if device[f"{name}_bytes"] or name != "host_page_tables":
                sizes.setdefault(name, []).append(prefix + format_bytes(device[f"{name}_bytes"]))
    order = REGION_ORDER + EXTRA
    return {name: sizes[name] for name in order if name in sizes}


def _legend(plan: Plan, y: int) -> list[str]:
    purposes = {**REGION_PURPOSE, **EXTRA_PURPOSE}
    parts = []
    for row, (name, sizes) in enumerate(_legend_sizes(plan).items()):
        top = y + row * ROW_HEIGHT
        fill = "url(#free)" if name == "free" else COLOR[name]
        parts += [f"<rect class=\"legend\" {_attrs(data_name=name)} x=\"{MARGIN}\" y=\"{top}\" width=\"14\" "
                  f"height=\"14\" fill=\"{fill}\" stroke=\"#666666\" stroke-width=\"0.5\"/>",
                  f"<text x=\"{MARGIN + 22}\" y=\"{top + 11}\" font-size=\"12\" font-weight=\"bold\">"
                  f"{escape(name)}</text>",
                  f"<text x=\"{MARGIN + 150}\" y=\"{top + 11}\" font-size=\"11\">{escape(', '.join(sizes))}</text>",
                  f"<text x=\"{MARGIN + 390}\" y=\"{top + 11}\" font-size=\"11\" fill=\"#444444\">"
                  f"{escape(purposes[name])}</text>"]
    return parts


def svg(plan: Plan) -> str:
    """A standalone SVG: one band per GPU, every region to scale, and a legend with sizes and purposes."""
    # One scale for every GPU, so that a smaller card draws a shorter band and GPUs compare at a glance.
    scale = (SVG_WIDTH - 2 * MARGIN) / max(d["vram_bytes"] for d in plan.devices)
    body = []
    for i, device in enumerate(plan.devices):
        body += _band(device, BANDS_TOP + i * (BAND_HEIGHT + BAND_GAP), scale)
    legend_top = BANDS_TOP + len(plan.devices) * (BAND_HEIGHT + BAND_GAP)
    body += _legend(plan, legend_top)
    height = legend_top + len(_legend_sizes(plan)) * ROW_HEIGHT + MARGIN
    head = [f"<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{SVG_WIDTH}\" height=\"{height}\" "
            f"viewBox=\"0 0 {SVG_WIDTH} {height}\" font-family=\"sans-serif\">",
            "<defs><pattern id=\"free\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" "
            "patternTransform=\"rotate(45)\"><rect width=\"6\" height=\"6\" fill=\"#f4f4f4\"/>"
            "<line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#c8c8c8\" stroke-width=\"2\"/></pattern></defs>",
            f"<rect width=\"{SVG_WIDTH}\" height=\"{height}\" fill=\"#ffffff\"/>",
            f"<text x=\"{MARGIN}\" y=\"28\" font-size=\"18\" font-weight=\"bold\">{escape(_title(plan))}</text>",
            f"<text x=\"{MARGIN}\" y=\"48\" font-size=\"12\" fill=\"#444444\">{escape(_settings_line(plan))}</text>"]
    return "\n".join(head + body + ["</svg>"]) + "\n"


# --- explain ---------------------------------------------------------------------------------------

def explain(plan: Plan) -> str:
    """Why each knob has its value, then the constraints that bind, wrapped for reading."""
    lines = _wrapped(f"Why each knob has its value ({_title(plan)}; {_settings_line(plan)}):", "", "") + [""]
    for knob, why in plan.explanations.items():
        value = f" = {_value(knob, plan.knobs[knob])}" if knob in plan.knobs else ""
        lines += [f"{knob}{value}"] + _wrapped(why, "    ", "    ")
    # The knobs without an explanation follow from the explained ones or are fixed; listing them keeps
    # every number of the plan in one place.
    rest = [f"{k} = {_value(k, v)}" for k, v in plan.knobs.items() if k not in plan.explanations]
    if rest:
        lines += ["", "Derived from the knobs above or fixed:"] + _wrapped("; ".join(rest), "    ", "    ")
    lines += [""] + _binding_section(plan)
    return "\n".join(lines)


# --- diff ------------------------------------------------------------------------------------------

def _flatten(mapping: dict, prefix: str = "") -> dict:
    """Nested settings as dotted keys, so one changed leaf reads as one line."""
    flat = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _changed(a: dict, b: dict) -> list[str]:
    """`key: a -> b` for every key whose value differs; a key missing on one side reads as `absent`."""
    lines = []
    for key in list(a) + [k for k in b if k not in a]:
        if a.get(key) != b.get(key):
            before = _value(key, a[key]) if key in a else "absent"
            after = _value(key, b[key]) if key in b else "absent"
            lines.append(f"{key}: {before} -> {after}")
    return lines


def _header_changes(a: Plan, b: Plan) -> list[str]:
    lines = []
    for what, x, y in (("model", a.model, b.model), ("profile", a.profile, b.profile)):
        if x.get("name") != y.get("name"):
            lines.append(f"{what}: {x.get('name')} -> {y.get('name')}")
        elif x.get("fingerprint") != y.get("fingerprint"):
            lines.append(f"{what}: {x.get('name')}, fingerprint {x.get('fingerprint')} -> {y.get('fingerprint')}")
    return lines + _changed(_flatten(a.settings), _flatten(b.settings))


def _region_change(name: str, x: dict | None, y: dict | None) -> str | None:
    if y is None:
        return f"{name}: removed ({_bytes(x['bytes'])})"
    if x is None:
        return f"{name}: added ({_bytes(y['bytes'])})"
    if x["bytes"] != y["bytes"]:
        delta = y["bytes"] - x["bytes"]
        sign = "+" if delta > 0 else "-"
        return (f"{name}: {_bytes(x['bytes'])} -> {_bytes(y['bytes'])}, "
                f"{sign}{format_bytes(abs(delta))} ({delta:+d} B)")
    if x["offset"] != y["offset"]:
        # Same size, but the runtime places it elsewhere: worth a line, since offsets are the contract.
        return f"{name}: same size, offset {x['offset']} -> {y['offset']}"
    return None


_DEVICE_FACTS = ("gpu", "vram_bytes", "reserved_bytes", "usable_bytes", "host_page_tables_bytes", "free_bytes", "blocks",
                 "holds_drafter")


def _device_facts(device: dict) -> dict:
    return {**{k: device.get(k) for k in _DEVICE_FACTS}, "blocks": _blocks(device)}


def _device_changes(x: dict | None, y: dict | None, index: int) -> list[str]:
    if x is None or y is None:
        present = x or y
        side = "b" if x is None else "a"
        lines = [f"GPU {index}: only in {side} ({present['gpu']}, {format_bytes(present['vram_bytes'])})"]
        verb = "added" if x is None else "removed"
        return lines + [f"  {r['name']}: {verb} ({_bytes(r['bytes'])})" for r in present["regions"]]
    facts = _changed(_device_facts(x), _device_facts(y))
    regions_x = {r["name"]: r for r in x["regions"]}
    regions_y = {r["name"]: r for r in y["regions"]}
    names = [n for n in REGION_ORDER if n in regions_x or n in regions_y]
    regions = [line for n in names if (line := _region_change(n, regions_x.get(n), regions_y.get(n)))]
    if not facts and not regions:
        return []
    return [f"GPU {index}:"] + _indent(facts + regions)


def _rate_changes(what: str, key: str, rows_a: list[dict], rows_b: list[dict]) -> list[str]:
    """tok/s per prompt length or depth, matched by that length, with the relative change."""
    a = {row[key]: row for row in rows_a}
    b = {row[key]: row for row in rows_b}
    lines = []
    for at in sorted(a.keys() | b.keys()):
        if at not in b or at not in a:
            lines.append(f"{what} {at}: only in {'a' if at in a else 'b'}")
        elif a[at]["tok_s"] != b[at]["tok_s"]:
            x, y = a[at]["tok_s"], b[at]["tok_s"]
            lines.append(f"{what} {at}: {_number(x)} -> {_number(y)} tok/s ({_percent_change(x, y)})")
    return lines


def _prediction_changes(a: dict, b: dict) -> list[str]:
    lines = (_rate_changes("prefill of", "prompt_tokens", a.get("prefill", []), b.get("prefill", []))
             + _rate_changes("decode at depth", "depth", a.get("decode", []), b.get("decode", [])))
    x, y = a.get("request_seconds"), b.get("request_seconds")
    if x != y:
        lines.append(f"request: {_number(x)} s -> {_number(y)} s ({_percent_change(x, y)})")
    return lines


def diff(a: Plan, b: Plan) -> str:
    """What changed from plan a to plan b: what they were made for, the layout, the knobs, the predictions."""
    count = max(len(a.devices), len(b.devices))
    devices = [line for i in range(count)
               for line in _device_changes(a.devices[i] if i < len(a.devices) else None,
                                           b.devices[i] if i < len(b.devices) else None, i)]
    sections = [("Model, profile and settings:", _header_changes(a, b)), ("Regions:", devices),
                ("Knobs:", _changed(a.knobs, b.knobs)), ("Predictions:", _prediction_changes(a.predictions,
                                                                                              b.predictions))]
    blocks = ["\n".join([heading] + _indent(body)) for heading, body in sections if body]
    if blocks:
        return "\n\n".join(blocks)
    if a.to_dict() == b.to_dict():
        return "the plans are identical"
    # Layout, knobs and predictions agree; say where the rest differs rather than claim identity.
    rest = [key for key, value in a.to_dict().items() if b.to_dict().get(key) != value]
    return f"same layout, knobs and predictions; the plans differ only in: {', '.join(rest)}"
