"""Every log line the docs quote is checked against a real run: the ```log convention, and its registry.

The convention and the registry are in ``tests/doc_log_lines.py``; the functional tests named there do the checking.
These tests fail fast, without a run, when a doc quotes a line that no functional test checks.
"""

import ast
from pathlib import Path

import pytest
from tests.doc_log_lines import CHECKS, REPO, docs, fenced_blocks, missing, pattern, quote_conditions, quoted_lines

DOCS = docs()
CHECK_CALL = "assert_doc_log_lines"


def _ids(paths):
    return [str(p.relative_to(REPO)) for p in paths]


@pytest.mark.timeout(30)
def test_quoted_lines_are_extracted_as_documented():
    text = """# T

Rank 0 logs:

```log
started at iteration …
…
  job info:
      launcher: …
started at iteration …
```

- In a list:

  ```log
  saved checkpoint at iteration … (blocking … s)
  ```

Not a log line: `inline code`, and

```text
| sample | output |
```

```python
print("not a log line")
```
"""
    assert quoted_lines(text) == [
        "started at iteration …",
        "job info:",
        "launcher: …",
        "saved checkpoint at iteration … (blocking … s)",
    ]
    assert [info for _, info, _ in fenced_blocks(text)] == ["log", "log", "text", "python"]


@pytest.mark.timeout(30)
def test_an_ellipsis_stands_for_any_text_within_one_output_line():
    output = (
        "2026-01-01 10:00:00,000 [rank0] INFO megatron.bridge.training.checkpointing: successfully loaded verified "
        "checkpoint /ckpt/iter_0000006 at iteration 6\n"
        "[2026-01-01 10:00:01,000] [WARNING] [RankMonServer812@vm:1] Section 'step' has been open for 6.12 seconds. "
        "Timeout is 6.00 seconds.\n"
    )
    assert not missing(
        [
            "successfully loaded verified checkpoint …/iter_… at iteration …",
            "[RankMonServer…] Section 'step' has been open for … seconds. Timeout is … seconds.",
            "Section 'step' has been open",  # a part of a line is enough
        ],
        output,
    )
    assert missing(["[RankMonitorServer…] Section 'step' has been open for …"], output)  # what 0.4.1 does not print
    assert missing(["at iteration 6 … Section"], output), "an ellipsis does not reach into the next line"
    assert pattern("a.b (c) …").pattern == r"a\.b\ \(c\)\ .*?"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_fenced_block_says_what_it_holds(doc):
    unlabelled = [line for line, info, _ in fenced_blocks(doc.read_text()) if not info]
    assert not unlabelled, (
        f"{doc.relative_to(REPO)}: fenced blocks without an info string start after line(s) {unlabelled}: say what "
        "each holds (```log for quoted log lines, which a functional test must check; ```text for output that is not "
        "a log line, such as one run's report)"
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_quoted_log_line_is_checked_by_a_functional_test(doc):
    checked = {line for lines in CHECKS.values() for line in lines}
    unchecked = [line for line in quoted_lines(doc.read_text()) if line not in checked]
    assert not unchecked, (
        f"{doc.relative_to(REPO)} quotes log lines no functional test checks: {unchecked}. Add each, exactly as "
        "written, to CHECKS in tests/doc_log_lines.py under a functional test whose run prints it (the main job's "
        "drill prints most), or reword the doc so it no longer quotes it."
    )


@pytest.mark.timeout(30)
def test_every_checked_line_is_still_quoted():
    quoted = {line for doc in DOCS for line in quoted_lines(doc.read_text())}
    stale = {test: [x for x in lines if x not in quoted] for test, lines in CHECKS.items()}
    stale = {test: lines for test, lines in stale.items() if lines}
    assert not stale, f"CHECKS has lines no doc quotes any more (the doc changed?): {stale}"


def _functions_that_check(tree: ast.Module) -> set[str]:
    """Top-level functions of the module that call the check, directly or through another top-level function."""
    calls = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            called = set()
            for sub in ast.walk(node):
                if isinstance(sub, ast.Call):
                    func = sub.func
                    called.add(func.id if isinstance(func, ast.Name) else getattr(func, "attr", ""))
            calls[node.name] = called
    checking = {name for name, called in calls.items() if CHECK_CALL in called}
    while True:
        more = {name for name, called in calls.items() if called & checking} - checking
        if not more:
            return checking
        checking |= more


@pytest.mark.timeout(30)
@pytest.mark.parametrize("test", sorted(CHECKS), ids=lambda test: test.split("/", 2)[-1])
def test_each_named_test_exists_and_runs_the_check(test):
    path, _, name = test.partition("::")
    assert path.startswith("tests/functional_tests/") and (REPO / path).is_file(), f"{test}: no such functional test"
    tree = ast.parse(Path(REPO, path).read_text(), path)
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert name in names, f"{path} has no test {name}"
    assert name in _functions_that_check(tree), f"{test} never calls {CHECK_CALL} on its run's output"
    assert CHECKS[test], f"{test} checks nothing"


@pytest.mark.timeout(30)
def test_a_block_for_some_releases_is_checked_only_with_them(monkeypatch):
    from tests import doc_log_lines

    text = "```log\nalways …\n```\n\n```log nvidia-resiliency-ext<0.6\nold …\n```\n\n"
    text += "```log nvidia-resiliency-ext>=0.6\nnew …\n```\n"
    assert quote_conditions(text) == {
        "always …": {""}, "old …": {"nvidia-resiliency-ext<0.6"}, "new …": {"nvidia-resiliency-ext>=0.6"}
    }  # fmt: skip
    assert quoted_lines(text) == ["always …", "old …", "new …"]  # every release's line needs a checking test
    monkeypatch.setattr(doc_log_lines, "docs", lambda: [doc])
    doc = REPO / "README.md"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: text)
    import importlib.metadata as metadata

    for installed, wanted in (("0.4.1", ["always …", "old …"]), ("0.7.0", ["always …", "new …"])):
        monkeypatch.setattr(metadata, "version", lambda name, v=installed: v)
        assert doc_log_lines.for_installed_releases(["always …", "old …", "new …"]) == wanted
