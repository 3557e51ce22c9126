"""Regenerate the field reference at the end of docs/configuration.md from the config models."""

from pathlib import Path

from rlhf_ray.config.reference import render_reference

MARKER = "## Field reference"

doc = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
text = doc.read_text()
head, intro = text[: text.index(MARKER)], text[text.index(MARKER):].split("\n\n", 2)[:2]
doc.write_text(head + "\n\n".join(intro) + "\n\n" + render_reference())
print(f"updated {doc}")
