"""What the README says about the embedded default model is what its config holds."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_describes_the_default_model_as_configured():
    config = json.loads((ROOT / "loopserve/models/default/config.json").read_text())
    text = " ".join((ROOT / "README.md").read_text().split())
    found = re.search(
        r"\((\d+) shared layers × (\d+) loops, hidden (\d+), [\d.]+M parameters, "
        r"(\d+)-token byte-level BPE\)",
        text,
    )
    assert found, "the README no longer describes the default model's shape"
    layers, loops, hidden, vocab = map(int, found.groups())
    assert (layers, loops, hidden, vocab) == (
        config["num_hidden_layers"],
        config["total_ut_steps"],
        config["hidden_size"],
        config["vocab_size"],
    )


def test_no_doc_describes_the_default_model_by_its_old_shape():
    """The first embedded model had 4 layers and hidden 128; docs that describe that model
    must say it was the earlier one."""
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            if "4 layers, hidden 128" in line and "earlier" not in line.lower():
                previous = doc.read_text().splitlines()[number - 2].lower()
                assert "earlier" in previous, f"{doc.name}:{number}: {line.strip()}"
