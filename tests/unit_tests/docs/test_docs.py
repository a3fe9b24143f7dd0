"""Docs and skills stay true to the code: snippets run, paths exist, overrides parse, the exit-code table matches,
and every command under a ``## Verification`` heading is run by a functional test."""

import ast
import itertools
import re
from pathlib import Path

import pytest
from tests.unit_tests.configs import base_config

from megatron.bridge.training.config import ConfigContainer
from megatron.bridge.training.exit_codes import ExitCode
from megatron.bridge.training.utils.overrides import apply_overrides

REPO = Path(__file__).resolve().parents[3]
DOCS = sorted([*REPO.glob("docs/**/*.md"), *REPO.glob("skills/**/*.md"), REPO / "README.md"])
_PY_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
_PATH = re.compile(r"`((?:src|tests|examples|docs|skills|scripts|benchmarks)/[\w./-]+)`")
_OVERRIDE = re.compile(r"(?<![\w.])((?:[a-z_]+\.)+[a-z_]+=[^\s`'\"\])]+)")
FUNCTIONAL_TESTS = REPO / "tests" / "functional_tests"
# A `## Verification` section runs to the next level-2 heading; its commands are in ```bash blocks.
_VERIFICATION = re.compile(r"^## Verification\b[^\n]*\n(.*?)(?=^## |\Z)", re.M | re.S)
_BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)
_OPTIONAL = re.compile(r" \[(-[^\]]*)\]")  # `cmd [--flag value]`: the command with and without it
_LOG_BLOCK = re.compile(r"^[ \t]*```log\n.*?^[ \t]*```", re.M | re.S)  # quoted log lines, not overrides


def _ids(paths):
    return [str(p.relative_to(REPO)) for p in paths]


def verification_commands(markdown: str) -> list[str]:
    """Every command in the ```bash blocks of the text's ``## Verification`` sections.

    Backslash continuations are joined, whitespace is collapsed to single spaces, comment lines are dropped, and each
    optional ``[--flag ...]`` gives two commands: with ``--flag ...`` and without it.
    """
    commands = []
    for section in _VERIFICATION.findall(markdown):
        for block in _BASH_BLOCK.findall(section):
            for line in block.replace("\\\n", " ").splitlines():
                line = " ".join(line.split())
                if not line or line.startswith("#"):
                    continue
                parts = _OPTIONAL.split(line)  # [text, option, text, option, ..., text]
                for chosen in itertools.product(*[("", f" {opt}") for opt in parts[1::2]]):
                    variant = parts[0] + "".join(opt + text for opt, text in zip(chosen, parts[2::2]))
                    if variant not in commands:
                        commands.append(variant)
    return commands


def declared_doc_commands() -> dict[str, list[str]]:
    """``{command: [test file, ...]}`` from the module-level ``DOC_COMMANDS`` tuples under tests/functional_tests.

    Read from the source (not imported): the functional tests need not be importable here.
    """
    declared: dict[str, list[str]] = {}
    for path in sorted(FUNCTIONAL_TESTS.rglob("*.py")):
        name = str(path.relative_to(REPO))
        tree = ast.parse(path.read_text(), name)
        for node in tree.body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if not any(isinstance(t, ast.Name) and t.id == "DOC_COMMANDS" for t in targets):
                continue
            value = ast.literal_eval(node.value)
            assert isinstance(value, tuple) and all(isinstance(c, str) for c in value), (
                f"{name}: DOC_COMMANDS must be a tuple of string literals"
            )
            used = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "DOC_COMMANDS"]
            assert any(isinstance(n.ctx, ast.Load) for n in used), f"{name} declares DOC_COMMANDS but never runs them"
            for command in value:
                declared.setdefault(" ".join(command.split()), []).append(name)
    return declared


VERIFIED_DOCS = [doc for doc in DOCS if verification_commands(doc.read_text())]


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_python_snippets_build_valid_configs(doc, monkeypatch):
    monkeypatch.setenv("FT_RANK_MONITOR_IPC_SOCKET", "/run/rmon.sock")  # snippets are meant for ft_launcher
    ipr_env = {"TORCH_CPP_LOG_LEVEL": "error", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "NCCL_NVLS_ENABLE": "0"}
    launcher_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "LOCAL_WORLD_SIZE": "2"}
    for name, value in {**ipr_env, **launcher_env}.items():
        monkeypatch.setenv(name, value)  # and for the environment the in-process restart section exports
    for block in _PY_BLOCK.findall(doc.read_text()):
        cfg = base_config()
        namespace = {"cfg": cfg}
        exec(compile(block, str(doc), "exec"), namespace)
        for value in namespace.values():
            if isinstance(value, ConfigContainer):
                value.validate(world_size=2)
        cfg.validate(world_size=2)


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_named_paths_exist(doc):
    missing = [p for p in _PATH.findall(doc.read_text()) if not (REPO / p.rstrip("/.")).exists()]
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_dotted_overrides_are_real_fields(doc):
    text = _LOG_BLOCK.sub("", doc.read_text())  # quoted log lines are checked against runs (test_log_lines.py)
    items = [item for item in _OVERRIDE.findall(text) if item.split(".")[0] in ConfigContainer.__dataclass_fields__]
    for item in items:
        apply_overrides(base_config(), [item])


def test_exit_code_table_matches_enum():
    text = (REPO / "docs" / "training" / "resiliency.md").read_text()
    rows = dict(re.findall(r"^\| (\d+) \| ([A-Z_]+) \|", text, re.M))
    assert {int(code): name for code, name in rows.items()} == {int(c): c.name for c in ExitCode}


def test_card_lists_existing_files():
    card = (REPO / "skills" / "resiliency" / "card.yaml").read_text()
    for path in re.findall(r"^\s+- (\S+)$", card, re.M):
        assert (REPO / path).exists(), path


def test_verification_commands_are_extracted_as_documented():
    text = """# T

## Verification

```bash
./run.sh [--simulate-fault]
python -m torch.distributed.run --nproc_per_node=2 \\
    example.py   [--slow-rank 1]
# a comment
tool dir --all
```

Look for `x`.

```text
not a command
```

## Pitfalls

```bash
not verified
```
"""
    assert verification_commands(text) == [
        "./run.sh",
        "./run.sh --simulate-fault",
        "python -m torch.distributed.run --nproc_per_node=2 example.py",
        "python -m torch.distributed.run --nproc_per_node=2 example.py --slow-rank 1",
        "tool dir --all",
    ]


def test_resiliency_docs_have_verification_commands():
    for doc in ("docs/training/resiliency.md", "docs/training/checkpointing.md", "skills/resiliency/SKILL.md"):
        assert REPO / doc in VERIFIED_DOCS, f"{doc} has no commands in a ```bash block under `## Verification`"


@pytest.mark.parametrize("doc", VERIFIED_DOCS, ids=_ids(VERIFIED_DOCS))
def test_verification_commands_are_run_by_functional_tests(doc):
    declared = declared_doc_commands()
    missing = [command for command in verification_commands(doc.read_text()) if command not in declared]
    assert not missing, (
        f"{doc.relative_to(REPO)}: no functional test runs these Verification commands: {missing}. A test under "
        "tests/functional_tests must list each exact string in its module-level DOC_COMMANDS tuple and execute it."
    )


def test_declared_doc_commands_are_verification_commands():
    documented = {command for doc in VERIFIED_DOCS for command in verification_commands(doc.read_text())}
    stale = {command: files for command, files in declared_doc_commands().items() if command not in documented}
    assert not stale, f"DOC_COMMANDS entries that no doc's Verification section has (a doc changed?): {stale}"
