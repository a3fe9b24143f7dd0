"""Config validation reads no environment variable missing from ``env_inputs.ENV_INPUTS``, and never asks CUDA.

The validation modules are parsed (``ast``): every ``os.environ`` / ``os.getenv`` read must name its variable with a
string, a module constant, or a loop variable over a module constant (a dict's keys, a tuple's items), and that
name must be listed. A launch variable read through :mod:`megatron.bridge.utils.launch_env` counts too:
``launch_env.current().<attribute>``, or ``<name> = launch_env.current()`` and then ``<name>.<attribute>`` in the same
function, reads the variables ``launch_env.VARIABLES`` gives for that attribute. The documented table
(``docs/training/config-reference.md``) must list the same names.
"""

import ast
import importlib
import inspect
import re
from pathlib import Path
from typing import Any, Optional

import pytest

from megatron.bridge.training.config_checks.env_inputs import ENV_INPUTS, NAMES
from megatron.bridge.utils import launch_env

VALIDATION_MODULES = (
    "megatron.bridge.training.config",
    "megatron.bridge.training.config_checks.container",
    "megatron.bridge.training.config_checks.resiliency",
    "megatron.bridge.training.config_checks.checkpoint",
    "megatron.bridge.training.config_checks.elastic",
    "megatron.bridge.training.config_checks.field_support",
    "megatron.bridge.utils.fields",
)
"""``ConfigContainer.validate()`` and the modules its checks live in."""

REFERENCE = Path(__file__).resolve().parents[3] / "docs" / "training" / "config-reference.md"


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _is_os_attr(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == name and getattr(node.value, "id", None) == "os"


def _evaluate(node: ast.expr, namespace: dict[str, Any]) -> Any:
    """The value of ``node`` built from constants and module globals only (no call but ``.items()``/``.keys()``)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("items", "keys"):
        return list(getattr(_evaluate(node.func.value, namespace), node.func.attr)())
    if not all(isinstance(n, (ast.Constant, ast.Name, ast.Attribute, ast.Load)) for n in ast.walk(node)):
        raise NameError(ast.unparse(node))
    return eval(compile(ast.Expression(node), "<key>", "eval"), dict(namespace))  # noqa: S307 - names only


def _loop_values(name: str, node: ast.AST, parents: dict, namespace: dict[str, Any]) -> Optional[list[Any]]:
    """The values loop variable ``name`` takes at ``node``: from the nearest loop or comprehension binding it."""
    while node in parents:
        node = parents[node]
        generators = (
            node.generators if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)) else []
        )
        loops = [(g.target, g.iter) for g in generators] + (
            [(node.target, node.iter)] if isinstance(node, ast.For) else []
        )
        for target, iterable in loops:
            names = [target] if isinstance(target, ast.Name) else list(getattr(target, "elts", []))
            for index, bound in enumerate(names):
                if isinstance(bound, ast.Name) and bound.id == name:
                    values = list(_evaluate(iterable, namespace))
                    return values if isinstance(target, ast.Name) else [v[index] for v in values]
    return None


def _keys(key: ast.expr, parents: dict, namespace: dict[str, Any]) -> list[str]:
    """The variable names ``key`` (the argument of one environment read) can be; fails when it cannot be told."""
    try:
        value = _evaluate(key, namespace)
    except NameError:
        value = _loop_values(key.id, key, parents, namespace) if isinstance(key, ast.Name) else None
    assert value is not None, f"cannot tell which variable `{ast.unparse(key)}` names: use a literal or a constant"
    return [value] if isinstance(value, str) else list(value)


def _is_launch_env_call(node: ast.AST) -> bool:
    """Whether ``node`` is ``launch_env.current(...)``."""
    return isinstance(node, ast.Call) and _is_attr_of(node.func, "launch_env", "current")


def _is_attr_of(node: ast.AST, owner: str, name: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == name and getattr(node.value, "id", None) == owner


def _launch_reads(module_name: str, call: ast.Call, parents: dict) -> list[tuple[int, str]]:
    """``(line, variable)`` for what the code does with one ``launch_env.current()``; fails on any other use."""
    use = parents.get(call)
    if isinstance(use, ast.Attribute) and use.attr in launch_env.VARIABLES:
        return [(use.lineno, name) for name in launch_env.VARIABLES[use.attr]]
    targets = getattr(use, "targets", None)
    assert isinstance(use, ast.Assign) and len(targets) == 1 and isinstance(targets[0], ast.Name), (
        f"{module_name}:{call.lineno}: `{ast.unparse(use)}`: read a LaunchEnv attribute, or name it and read those"
    )
    scope = use
    while scope in parents and not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        scope = parents[scope]
    found: list[tuple[int, str]] = []
    for node in ast.walk(scope):
        if isinstance(node, ast.Name) and node.id == targets[0].id and isinstance(node.ctx, ast.Load):
            attr = parents.get(node)
            assert isinstance(attr, ast.Attribute) and attr.attr in launch_env.VARIABLES, (
                f"{module_name}:{node.lineno}: `{ast.unparse(attr)}` uses the launch environment whole"
            )
            found += [(attr.lineno, name) for name in launch_env.VARIABLES[attr.attr]]
    return found


def environment_reads(module_name: str) -> list[tuple[int, str]]:
    """``(line, variable)`` for every environment read in ``module_name``; fails on a read it cannot resolve."""
    module = importlib.import_module(module_name)
    tree = ast.parse(inspect.getsource(module))
    parents, namespace = _parents(tree), vars(module)
    reads: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if _is_launch_env_call(node):
            reads += _launch_reads(module_name, node, parents)
        if isinstance(node, ast.ImportFrom) and node.module == launch_env.__name__:
            raise AssertionError(f"{module_name}:{node.lineno}: import launch_env and call launch_env.current()")
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            imported = {alias.name for alias in node.names} & {"environ", "getenv", "environb", "getenvb"}
            assert not imported, f"{module_name}:{node.lineno}: import os and read os.environ (checked here)"
        if _is_os_attr(node, "getenv") or _is_os_attr(node, "getenvb"):
            call = parents.get(node)
            assert isinstance(call, ast.Call) and call.func is node and call.args, f"{module_name}:{node.lineno}"
            reads += [(node.lineno, k) for k in _keys(call.args[0], parents, namespace)]
        elif _is_os_attr(node, "environ") or _is_os_attr(node, "environb"):
            use = parents.get(node)
            call = parents.get(use)
            if isinstance(use, ast.Subscript) and use.value is node:
                key = use.slice
            elif isinstance(use, ast.Attribute) and use.attr == "get" and isinstance(call, ast.Call) and call.args:
                key = call.args[0]
            elif isinstance(use, ast.Compare) and use.comparators == [node] and len(use.ops) == 1:
                key = use.left  # "NAME" in os.environ
            else:
                raise AssertionError(f"{module_name}:{node.lineno}: `{ast.unparse(use)}` reads the environment whole")
            reads += [(node.lineno, k) for k in _keys(key, parents, namespace)]
    return reads


def cuda_queries(module_name: str) -> list[int]:
    """Lines of ``module_name`` that use ``torch.cuda``."""
    tree = ast.parse(inspect.getsource(importlib.import_module(module_name)))
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "cuda"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module_name", VALIDATION_MODULES)
def test_validation_reads_only_the_listed_environment_variables(module_name):
    unlisted = [(line, name) for line, name in environment_reads(module_name) if name not in NAMES]
    assert not unlisted, (
        f"{module_name} reads environment variables not in env_inputs.ENV_INPUTS (line, name): {unlisted}. List "
        "each with its reason there and in the table of docs/training/config-reference.md, or take it from the config"
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module_name", VALIDATION_MODULES)
def test_validation_never_asks_cuda(module_name):
    assert not cuda_queries(module_name), f"{module_name} uses torch.cuda (lines {cuda_queries(module_name)})"


@pytest.mark.timeout(60)
def test_the_launcher_variables_are_all_found_and_listed():
    found = {name for module in VALIDATION_MODULES for _, name in environment_reads(module)}
    expected = {"WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "FT_RANK_MONITOR_IPC_SOCKET"}
    expected |= {"TORCH_CPP_LOG_LEVEL", "TORCH_NCCL_RETHROW_CUDA_ERRORS", "NCCL_NVLS_ENABLE", "MBRIDGE_FAULTS"}
    assert expected <= found, f"the parser missed reads: {expected - found}"
    assert found == NAMES, f"listed but read nowhere: {NAMES - found}"
    assert all(reason and "\n" not in reason for _, reason in ENV_INPUTS)
    assert len(NAMES) == len(ENV_INPUTS), "a name is listed twice"


@pytest.mark.timeout(60)
def test_the_documented_table_lists_the_same_variables():
    rows = re.findall(r"^\| `([A-Z_]+)` \| [^|]+ \| [^|]+ \|$", REFERENCE.read_text(), re.M)
    assert sorted(rows) == sorted(NAMES)


@pytest.mark.timeout(60)
def test_an_unlisted_read_is_caught(tmp_path, monkeypatch):
    source = (
        "import os\nTABLE = {'WORLD_SIZE': 1, 'SECRET_KNOB': 2}\n"
        "def check():\n"
        "    a = [os.environ.get(k) for k in TABLE]\n"
        "    return os.getenv('OTHER'), 'X' in os.environ, os.environ['Y'], a\n"
    )
    (tmp_path / "probe_env_module.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    names = sorted(name for _, name in environment_reads("probe_env_module"))
    assert names == ["OTHER", "SECRET_KNOB", "WORLD_SIZE", "X", "Y"]
    (tmp_path / "probe_env_whole.py").write_text("import os\ndef f(k):\n    return dict(os.environ), os.getenv(k)\n")
    with pytest.raises(AssertionError, match="reads the environment whole"):
        environment_reads("probe_env_whole")
    (tmp_path / "probe_env_param.py").write_text("import os\ndef f(k):\n    return os.getenv(k)\n")
    with pytest.raises(AssertionError, match="cannot tell which variable `k` names"):
        environment_reads("probe_env_param")


@pytest.mark.timeout(60)
def test_a_read_through_launch_env_is_found(tmp_path, monkeypatch):
    source = (
        "from megatron.bridge.utils import launch_env\n"
        "def check():\n"
        "    launch = launch_env.current()\n"
        "    return launch.rank, launch.master_endpoint(), launch_env.current().job_id\n"
    )
    (tmp_path / "probe_launch_module.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    names = sorted(name for _, name in environment_reads("probe_launch_module"))
    assert names == ["MASTER_ADDR", "MASTER_PORT", "RANK", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"]
    whole = "from megatron.bridge.utils import launch_env\ndef f():\n    return launch_env.current()\n"
    (tmp_path / "probe_launch_whole.py").write_text(whole)
    with pytest.raises(AssertionError, match="read a LaunchEnv attribute"):
        environment_reads("probe_launch_whole")
    passed = "from megatron.bridge.utils import launch_env\ndef f(g):\n    e = launch_env.current()\n    return g(e)\n"
    (tmp_path / "probe_launch_passed.py").write_text(passed)
    with pytest.raises(AssertionError, match="uses the launch environment whole"):
        environment_reads("probe_launch_passed")
