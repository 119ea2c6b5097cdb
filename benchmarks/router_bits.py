"""Does a token's router score depend on how many tokens share its step? Per router shape and weight format, CPU.

    .venv/bin/python benchmarks/router_bits.py [--threads 1,2] [--json OUT]

For each (experts, hidden) of real MoE routers and the demo's, a float32 router with random weights scores 128
random tokens at once, then the first 1, 2, 12, 16, 17 and 44 of them alone; prints, per weight format (oneDNN's
packed GEMM, which the router used before, and the panel linear, which a float32 CPU engine now uses:
shared/model/routing.py), the batch sizes whose scores are not bit-equal to the same tokens' in the whole batch.
A router must have none: its scores pick the experts, and a chunked, layer-streamed or recomputed prompt must
route as the whole one did. Exits 0 either way: it reports, it does not judge.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.model import routing  # noqa: E402
from shared.model.kernels import cpu_moe  # noqa: E402
from shared.model.panel_linear import use_panel_linears  # noqa: E402
from shared.model.router_config import RouterConfig, Scoring  # noqa: E402

SHAPES = {"demo": (8, 512), "olmoe": (64, 2048), "qwen3-30b-a3b": (128, 2048), "deepseek-v3": (256, 7168)}
ROWS = (1, 2, 12, 16, 17, 44)


def differing_rows(experts: int, hidden: int, fmt: str, kernel: cpu_moe.Kernel | None) -> list[int] | None:
    """The batch sizes whose scores differ from the whole batch's; None where the format is unavailable here."""
    router = routing.Router(RouterConfig(num_experts=experts, top_k=2, scoring=Scoring.SOFTMAX), hidden)
    torch.nn.init.normal_(router.weight, std=0.1)
    if fmt == "panel":
        if kernel is None:
            return None
        use_panel_linears(router, kernel)
    router.prepack()  # packs the weight unless the panels serve it
    x = torch.randn(128, hidden, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        whole = router.logits(x)
        return [rows for rows in ROWS if not torch.equal(router.logits(x[:rows]), whole[:rows])]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    kernel = cpu_moe.load()
    results = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for name, (experts, hidden) in SHAPES.items():
            for fmt in ("packed", "panel"):
                rows = differing_rows(experts, hidden, fmt, kernel)
                results.append({"threads": threads, "router": name, "experts": experts, "hidden": hidden,
                                "format": fmt, "differing_batch_sizes": rows})  # fmt: skip
                shown = "unavailable here" if rows is None else (", ".join(map(str, rows)) or "none")
                print(f"threads {threads}  {name:14s} ({experts:3d}, {hidden:4d})  {fmt:6s}  differ at: {shown}")
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "results": results}, indent=1))


if __name__ == "__main__":
    main()
