"""The user's own code named `module:name` or `path/to/file.py:name`: found from the working
directory whatever is on `sys.path`, loaded once, and every way it can fail said with where it looked."""

from __future__ import annotations

import os
import sys

import pytest

from rolectl.roles.engines.user_code import resolve_object


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A working directory that is not on `sys.path`, as under the `rolectl` console script."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    return tmp_path


def test_a_module_in_the_working_directory_resolves_without_it_on_the_path(project):
    (project / "cwd_module_a.py").write_text("def score(response, answer):\n    return 0.25\n")
    fn = resolve_object("cwd_module_a:score", what="reward")
    assert fn("x", "y") == 0.25
    assert sys.path[0] == os.getcwd()  # where `python -m` puts it


def test_a_file_resolves_relative_to_the_working_directory_once(project):
    (project / "sub").mkdir()
    (project / "sub" / "rewards.py").write_text("import itertools\nCOUNT = next(itertools.count())\n"
                                                "class Env:\n    pass\n")
    first = resolve_object("sub/rewards.py:Env", what="environment", kind="class")
    assert resolve_object("./sub/rewards.py:Env", what="environment", kind="class") is first
    assert first.__name__ == "Env" and sys.modules[first.__module__].__file__ == str(project / "sub" / "rewards.py")


def test_builtins_come_first():
    marker = object()
    assert resolve_object("mine", what="reward", builtins={"mine": marker}) is marker


@pytest.mark.parametrize("spec,fragments", [
    ("nope", ["unknown reward 'nope'", "built-ins: ['mine']", "'module:function'", "'path/to/file.py:function'"]),
    ("no_such_module_q:f", ["cannot import module 'no_such_module_q'", "no no_such_module_q.py",
                            "in the working directory {cwd}", "'path/to/no_such_module_q.py:f'"]),
    ("broken_q:f", ["importing 'broken_q' failed", "ZeroDivisionError", "broken_q.py:1"]),
    ("needs_missing_q:f", ["importing 'needs_missing_q' failed", "No module named 'not_installed_q'"]),
    ("plain_q:missing", ["has no function 'missing'"]),
    ("nowhere/x.py:f", ["no such file nowhere/x.py", "working directory {cwd}"]),
    ("bad_file_q.py:f", ["running bad_file_q.py failed", "SyntaxError"]),
])
def test_what_cannot_be_found_says_where_it_looked(project, spec, fragments):
    (project / "broken_q.py").write_text("1 / 0\n")
    (project / "needs_missing_q.py").write_text("import not_installed_q\n")
    (project / "plain_q.py").write_text("x = 1\n")
    (project / "bad_file_q.py").write_text("def f(:\n")
    with pytest.raises(ValueError) as caught:
        resolve_object(spec, what="reward", builtins={"mine": 1})
    for fragment in fragments:
        assert fragment.format(cwd=project) in str(caught.value), str(caught.value)
