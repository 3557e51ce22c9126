"""Regenerate the per-GPU memory table of the shipped GPU recipes in docs/configuration.md."""

from pathlib import Path

from rlhf_ray.memory.recipes import update

root = Path(__file__).resolve().parent.parent
update(root / "docs" / "configuration.md", root)
print(f"updated {root / 'docs' / 'configuration.md'}")
