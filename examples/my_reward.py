"""Your own reward, as examples/own_model.yaml names it: `examples/my_reward.py:within_tolerance`.

A reward is a plain function of the decoded response and the row's answer. Declaring the keyword
`row` (and/or `prompt`) gives it the whole data row as a dict of every column, here a tolerance per
problem; the two-argument form `fn(response, answer)` works too. rolectl reads the signature once,
when the job is loaded, and refuses one it cannot call. Run it yourself:

    python -c "import sys; sys.path.insert(0, 'examples'); from my_reward import within_tolerance as f; \
print(f('about 25', '23', row={'tolerance': 2}))"
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def within_tolerance(response: str, answer: str, *, row: dict) -> float:
    """1 when the response's first number is within the row's `tolerance` of the answer, else 0."""
    found = _NUMBER.search(response)
    if found is None:
        return 0.0
    return 1.0 if abs(float(found.group()) - float(answer)) <= float(row.get("tolerance", 0)) else 0.0
