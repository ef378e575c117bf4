"""Serve mode: an OpenAI-compatible endpoint on an explorer, and the reward intake that turns served
traffic into experiences (see docs/serve.md)."""

from .explorer import ServingExplorer, serve_problems

__all__ = ["ServingExplorer", "serve_problems"]
