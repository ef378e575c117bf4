"""rolectl's tests: a package so that shared helpers import as `tests.support.*` (pytest's pythonpath is ".")."""
