"""The plan: byte-exact regions per GPU, knobs, predictions, what binds, and what it was solved from.

Written as YAML (or JSON) with a versioned schema and validated on load: a plan whose regions overlap or
overflow, or that was made for another model or profile, is refused with what differs.
"""

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from planner.document import read_document
from planner.errors import StratumError
from planner.layout import REGION_ORDER, Region

SCHEMA = "stratum-plan/3"   # 2: kv_ring after the expert regions (planner.kv_lending); 3: host page tables


@dataclass
class Plan:
    model: dict             # name, fingerprint, summary (see Model.summary)
    profile: dict           # name, fingerprint
    settings: dict          # context_tokens, kv, mtp, page_tokens, workload
    devices: list           # per GPU: index, gpu, vram/reserved/usable/host page tables/used/free bytes, blocks, regions
    knobs: dict
    predictions: dict       # prefill per prompt length, decode per depth, request seconds
    binding: list           # the constraints that bind, in words
    explanations: dict = field(default_factory=dict)   # knob -> why it has its value
    schema: str = SCHEMA

    @property
    def regions(self) -> list[Region]:
        return [Region(r["name"], d["index"], r["offset"], r["bytes"]) for d in self.devices for r in d["regions"]]

    def device_bytes(self, device: int) -> int:
        """What the runtime allocates on a GPU, its one arena: from the first region's start to the last one's end."""
        return max((r.end for r in self.regions if r.device == device), default=0)

    def allocated_bytes(self, device: int) -> int:
        """What the plan takes from a GPU's free memory: its arena, and the page tables the driver builds to map
        the pinned host copies (planner.layout.host_page_table_bytes)."""
        return self.device_bytes(device) + self.devices[device]["host_page_tables_bytes"]

    def to_dict(self) -> dict:
        """A deep copy: editing it never edits the plan."""
        return copy.deepcopy({"schema": self.schema, "model": self.model, "profile": self.profile, "settings": self.settings,
                "devices": self.devices, "knobs": self.knobs, "predictions": self.predictions,
                "binding": self.binding, "explanations": self.explanations})

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, width=120)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path):
        path = Path(path)
        path.write_text(self.to_json() if path.suffix == ".json" else self.to_yaml())

    def check_matches(self, model=None, profile=None):
        """Refuse to use this plan with another model or GPU, saying what differs."""
        if model is not None and model.fingerprint != self.model["fingerprint"]:
            differences = [f"{key}: plan {value}, model {model.summary.get(key)}"
                           for key, value in self.model["summary"].items() if model.summary.get(key) != value]
            detail = "; ".join(differences) or "same sizes, but tensor names, types or shapes differ"
            raise StratumError(f"this plan was made for model {self.model['name']!r} "
                               f"(fingerprint {self.model['fingerprint']}), not {model.name!r} "
                               f"({model.fingerprint}): {detail}", source=model.source)
        if profile is not None and profile.fingerprint != self.profile["fingerprint"]:
            raise StratumError(f"this plan was made for hardware profile {self.profile['name']!r} "
                               f"(fingerprint {self.profile['fingerprint']}), not {profile.name!r} "
                               f"({profile.fingerprint}): its figures differ; plan again", source=profile.source)


_REQUIRED = {"schema": str, "model": dict, "profile": dict, "settings": dict, "devices": list, "knobs": dict,
             "predictions": dict, "binding": list}


def load_plan(path, model=None, hardware=None) -> Plan:
    """Read and validate a plan; with a model or hardware profile, also check the plan was made for them."""
    plan = parse_plan(read_document(path, "plan file"), str(path))
    if model is not None or hardware is not None:
        from planner.model import load_model
        from planner.profile import load_profile
        plan.check_matches(model=load_model(model) if isinstance(model, (str, Path)) else model,
                           profile=load_profile(hardware) if isinstance(hardware, (str, Path)) else hardware)
    return plan


def parse_plan(document, source: str = "plan") -> Plan:
    if not isinstance(document, dict):
        raise StratumError("expected a plan mapping", source=source)
    if document.get("schema") != SCHEMA:
        raise StratumError(f"schema {document.get('schema')!r} is not {SCHEMA!r}: this plan was written by "
                           "another stratum version; plan again", source=source, field="schema")
    for key, kind in _REQUIRED.items():
        if not isinstance(document.get(key), kind):
            raise StratumError(f"missing or not a {kind.__name__}", source=source, field=key)
    for key in ("name", "fingerprint", "summary"):
        if key not in document["model"]:
            raise StratumError("missing", source=source, field=f"model.{key}")
    if "fingerprint" not in document["profile"]:
        raise StratumError("missing", source=source, field="profile.fingerprint")
    for d, device in enumerate(document["devices"]):
        _check_device(device, source, f"devices[{d}]")
    return Plan(model=document["model"], profile=document["profile"], settings=document["settings"],
                devices=document["devices"], knobs=document["knobs"], predictions=document["predictions"],
                binding=document["binding"], explanations=document.get("explanations") or {})


def _check_device(device, source: str, where: str):
    if not isinstance(device, dict):
        raise StratumError("expected a mapping", source=source, field=where)
    for key in ("index", "usable_bytes", "host_page_tables_bytes", "regions"):
        if key not in device:
            raise StratumError("missing", source=source, field=f"{where}.{key}")
    end = 0
    for r, region in enumerate(device["regions"]):
        at = f"{where}.regions[{r}]"
        if not isinstance(region, dict) or region.get("name") not in REGION_ORDER:
            raise StratumError(f"expected a region named one of {', '.join(REGION_ORDER)}", source=source, field=at)
        offset, size = region.get("offset"), region.get("bytes")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, size)):
            raise StratumError("offset and bytes must be non-negative integers", source=source, field=at)
        if offset < end:
            raise StratumError(f"overlaps the region before it (starts at {offset}, previous ends at {end})",
                               source=source, field=at)
        end = offset + size
    page_tables = device["host_page_tables_bytes"]
    if not isinstance(page_tables, int) or isinstance(page_tables, bool) or page_tables < 0:
        raise StratumError("must be a non-negative integer", source=source, field=f"{where}.host_page_tables_bytes")
    if end + page_tables > device["usable_bytes"]:
        raise StratumError(f"regions end at {end} bytes and the host page tables take {page_tables}, past the "
                           f"{device['usable_bytes']} usable", source=source, field=where)
