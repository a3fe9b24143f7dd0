"""The GPU check's arithmetic and its report: FLOPs per token, the card's peak, and the Markdown/JSON/logs it writes.

MFU = tokens per second x training FLOPs per token / the card's dense bf16 peak. FLOPs per token
(:func:`flops_per_token`) count the matrix products of a forward and backward pass as 6 x the parameters they
multiply by (every layer's attention projections and SwiGLU MLP, and the output layer; the input embedding is a
lookup), plus the attention scores and their use, 12 x layers x hidden x sequence length (the usual count, which does
not halve for the causal mask). The peak is looked up by the card's name (:data:`PEAKS`, NVIDIA's dense bf16 figures
without sparsity); for a card not listed MFU is left out and the report says so.
"""

import io
import json
import tarfile
from pathlib import Path
from typing import Any

PEAKS = (
    ("H200 NVL", 835e12), ("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),
    ("H800", 989e12), ("A100", 312e12), ("B200", 2250e12),
)  # fmt: skip
"""Dense bf16 peak FLOP/s by a part of the card's name, the more specific names first (GH200 matches H200)."""
LOG_LIMIT = 4 * 2**20
"""Bytes of one log kept in the archive (its end): the archive must come back from a machine that caps file sizes."""


def flops_per_token(dims: dict[str, int]) -> int:
    """Training FLOPs per token of the Llama ``dims`` describe (see the module doc)."""
    h, layers, ffn = dims["hidden"], dims["layers"], dims["ffn"]
    kv = h // dims["heads"] * dims["groups"]  # key and value widths with grouped-query attention
    attention = h * (h + 2 * kv) + h * h  # query/key/value projection, output projection
    mlp = h * 2 * ffn + ffn * h  # SwiGLU: gate and up projections, then down
    multiplied = layers * (attention + mlp) + h * dims["vocab"]  # and the output layer
    return 6 * multiplied + 12 * layers * h * dims["seq"]


def peak_flops() -> tuple[str, float]:
    """The CUDA card's name and its dense bf16 peak FLOP/s (0 when the name is not in :data:`PEAKS`)."""
    import torch

    name = torch.cuda.get_device_name()
    for part, peak in PEAKS:
        if part.lower() in name.lower():
            return name, peak
    return name, 0.0


def _value(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {_value(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def markdown(report: dict[str, Any]) -> str:
    """The report for people: provenance, one table row per part, then each part's figures and problems."""
    p = report["provenance"]
    m = report["model"]
    packages = ", ".join(f"{k} {v}" for k, v in p["packages"].items())
    lines = [
        f"# GPU check ({report['mode']}): {'PASSED' if report['passed'] else 'FAILED'}",
        "",
        f"Measured {p['date']} on {p['cpu']}, {p['ram']}, device: {report['device']} (GPUs: {p['gpu']}); "
        f"Python {p['python']}, CUDA {report['cuda']}, {packages}; commit {p['commit']}; {report['seconds']} s.",
        "",
        f"Model: {m['recipe']} with {m['layers']} layers of width {m['hidden']} (MLP {m['ffn']}, {m['heads']} heads "
        f"over {m['groups']} key/value groups, vocabulary {m['vocab']}), sequences of {m['seq']}, batch {m['batch']} "
        f"(micro-batch {m['micro']}), {m['dtype']}, one rank ({m['backend']}); {m['iterations']} iterations, faults "
        f"at iteration {m['fault_at']}.",
        "",
        "| part | passed | seconds |",
        "|---|---|---|",
    ]
    for x in report["parts"]:
        lines.append(f"| {x['key']}. {x['title']} | {'yes' if x['passed'] else 'NO'} | {x['seconds']} |")
    for part in report["parts"]:
        lines += ["", f"## {part['key']}. {part['title']}", ""]
        lines += [f"- {name}: {_value(value)}" for name, value in part["figures"].items()]
        lines += [f"- **problem**: {problem}" for problem in part["problems"]]
        if part["log_tail"]:
            lines += ["", "```text", part["log_tail"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def write_reports(report: dict[str, Any], outdir: Path, scratch: Path) -> None:
    """``gpu_check.json``, ``gpu_check.md`` and ``gpu_check_logs.tar.gz`` (every run's log and events) in ``outdir``."""
    (outdir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (outdir / "gpu_check.md").write_text(markdown(report))
    wanted = ("*/*.log", "*/events/*", "*/inprocess/*.log", "*.jsonl")  # not the corpus (data/)
    with tarfile.open(outdir / "gpu_check_logs.tar.gz", "w:gz") as archive:
        for path in sorted({f for pattern in wanted for f in scratch.glob(pattern) if f.is_file()}):
            data = path.read_bytes()[-LOG_LIMIT:]
            info = tarfile.TarInfo(str(path.relative_to(scratch)))
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
