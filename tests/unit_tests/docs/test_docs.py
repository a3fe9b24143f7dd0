"""Docs and skills stay true to the code: snippets run, paths exist, overrides parse, the exit-code table matches."""

import re
from pathlib import Path

import pytest

from megatron.bridge.training.config import ConfigContainer
from megatron.bridge.training.exit_codes import ExitCode
from megatron.bridge.training.utils.overrides import apply_overrides

REPO = Path(__file__).resolve().parents[3]
DOCS = sorted([*REPO.glob("docs/**/*.md"), *REPO.glob("skills/**/*.md"), REPO / "README.md"])
_PY_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
_PATH = re.compile(r"`((?:src|tests|examples|docs|skills|scripts|benchmarks)/[\w./-]+)`")
_OVERRIDE = re.compile(r"(?<![\w.])((?:[a-z_]+\.)+[a-z_]+=[^\s`'\"\])]+)")


def _ids(paths):
    return [str(p.relative_to(REPO)) for p in paths]


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_python_snippets_build_valid_configs(doc, monkeypatch):
    monkeypatch.setenv("FT_RANK_MONITOR_IPC_SOCKET", "/run/rmon.sock")  # snippets are meant for ft_launcher
    ipr_env = {"TORCH_CPP_LOG_LEVEL": "error", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "NCCL_NVLS_ENABLE": "0"}
    launcher_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "LOCAL_WORLD_SIZE": "2"}
    for name, value in {**ipr_env, **launcher_env}.items():
        monkeypatch.setenv(name, value)  # and for the environment the in-process restart section exports
    for block in _PY_BLOCK.findall(doc.read_text()):
        cfg = ConfigContainer()
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
    text = doc.read_text()
    items = [item for item in _OVERRIDE.findall(text) if item.split(".")[0] in ConfigContainer.__dataclass_fields__]
    for item in items:
        apply_overrides(ConfigContainer(), [item])


def test_exit_code_table_matches_enum():
    text = (REPO / "docs" / "training" / "resiliency.md").read_text()
    rows = dict(re.findall(r"^\| (\d+) \| ([A-Z_]+) \|", text, re.M))
    assert {int(code): name for code, name in rows.items()} == {int(c): c.name for c in ExitCode}


def test_card_lists_existing_files():
    card = (REPO / "skills" / "resiliency" / "card.yaml").read_text()
    for path in re.findall(r"^\s+- (\S+)$", card, re.M):
        assert (REPO / path).exists(), path
