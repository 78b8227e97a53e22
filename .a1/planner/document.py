"""Reading the project's YAML (and JSON) files: one way to turn a path into a document or one clear error."""

import json
from pathlib import Path

import yaml

from planner.errors import StratumError


def read_document(path, what: str):
    """The parsed file; a missing file or bad syntax is refused naming the file and `what` it should be."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) else "not text"
        raise StratumError(f"cannot read {what}: {reason}", source=source) from None
    is_json = source.endswith(".json")
    try:
        return json.loads(text) if is_json else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as err:
        raise StratumError(f"not valid {'JSON' if is_json else 'YAML'} for a {what}: {err}".replace("\n", " "),
                           source=source) from None
