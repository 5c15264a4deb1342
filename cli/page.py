"""The inspect page generate.py writes (`inspect=page.html`): the template cli/inspect.html with
a decode's recording (model.recorder.DecodeRecorder) inlined as JSON, one self-contained file,
written complete or not at all (an earlier page at that path stays if the write fails)."""

import json
from pathlib import Path

from model.checkpoint import write_atomically

TEMPLATE = Path(__file__).with_name("inspect.html")


def write_inspect_page(path, record: dict, pieces: list[str]) -> int:
    """Write the page of `record` to path, with `pieces` the text of each of its tokens; returns its
    size in bytes."""
    data = json.dumps(record | {"pieces": pieces}, separators=(",", ":"), allow_nan=False)
    data = data.replace("<", "\\u003c")  # no "</script>" can end the data early
    page = TEMPLATE.read_text(encoding="utf-8").replace("/*DATA*/null", data, 1)
    encoded = page.encode("utf-8")
    write_atomically(Path(path).expanduser(), lambda f: f.write(encoded), "inspect page")
    return len(encoded)
