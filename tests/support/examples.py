"""What the tests of the shipped examples share about them."""

from __future__ import annotations

LATER_STAGES = frozenset({"lora_quickstart.yaml", "dpo_quickstart.yaml"})
"""Examples that start from what earlier commands make under runs/ (their headers say which: the SFT
base, the DPO pairs): the engines' check would look for those files, so these load without it."""
