"""Who does what: trainer, explorers, synchronizer, dashboard; engines; the rolectl CLI."""
