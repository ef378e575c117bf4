"""Helpers shared by the tests: `wait` (one bounded wait for a condition), `e2e` (jobs of real role
processes), `scripted_job` (a small job against the real synchronizer), `reducer_scenario` (the
reducer's step-by-step scenarios) and `tiny_llm` (the quickstart's tiny model for engine tests)."""
