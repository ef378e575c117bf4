"""Serve mode: an OpenAI-compatible endpoint on an explorer, and the reward intake that turns served
traffic into experiences (see docs/serve.md)."""

from .explorer import ServeLoop, serve_problems, serving_explorer

__all__ = ["ServeLoop", "serving_explorer", "serve_problems"]
