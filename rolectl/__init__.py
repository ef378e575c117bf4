"""rolectl: RL fine-tuning roles (trainer, explorers, synchronizer) coordinated over NATS.

The repository keeps its layers as top-level folders (`sync_protocol/`, `bus/`, `roles/`); the build
maps them under this one installed namespace, so an installed rolectl is `rolectl.*` and nothing else.
"""

__all__ = ["__version__"]


def __getattr__(name: str) -> str:
    # looked up on use: importlib.metadata pulls in threading and email, which the pure core must not
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("rolectl")
        except PackageNotFoundError:  # a source tree that was never installed
            return "0.0.0"
    raise AttributeError(f"module 'rolectl' has no attribute {name!r}")
