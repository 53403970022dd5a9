"""``h2jax align``'s outputs: the JSON report, the loss-curve PNG and the terminal tables."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from h2jax._console import make_console
from h2jax.align._levels import LayerLevel, OpLevel, layer_status
from h2jax.align._runlevel import RunLevel

_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red"}


def _st(status: str) -> str:
    return f"[{_STYLE[status]}]{status}[/]"


def _num(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.2e}"


@dataclass
class AlignReport:
    """Everything one ``h2jax align`` found; ``gates`` holds each level's pass/fail."""

    chips: dict[str, str]  # chip -> policy description
    op: OpLevel | None = None
    layer: LayerLevel | None = None
    run: RunLevel | None = None
    out_dir: Path | None = None
    notes: list[str] = field(default_factory=list)  # what a level did not cover, said plainly

    def gates(self) -> dict[str, bool]:
        out = {}
        if self.op is not None:
            out["op"] = self.op.passed()
        if self.layer is not None:
            out["layer"] = self.layer.passed()
        if self.run is not None:
            out["run"] = self.run.passed()
        return out

    def passed(self) -> bool:
        return all(self.gates().values())

    def to_dict(self, *, all_ops: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {"chips": self.chips, "gates": self.gates(), "passed": self.passed(), "notes": self.notes}
        if self.op is not None:
            op = self.op
            rows = op.rows if all_ops else [r for r in op.rows if any(s != "pass" for s in r.status.values())]
            d["op_level"] = {
                "num_ops": op.num_ops,
                "compared": len(op.rows),
                "seconds": op.seconds,
                "first_fail": {c: r.to_dict() for c, r in op.first_fail.items()},
                "replay": op.dumps,
                "counts": {c: _counts([r.status[c] for r in op.rows]) for c in op.chips},
                "ops": [r.to_dict() for r in rows],
                "ops_listed": "all" if all_ops else "not passing on some chip",
            }
        if self.layer is not None:
            lay = self.layer
            d["layer_level"] = {
                "gate": lay.gate,
                "seconds": lay.seconds,
                "loss": lay.loss,
                "first_divergent": lay.first_divergent,
                "rows": [r.to_dict() for r in lay.rows],
            }
        if self.run is not None:
            run = self.run
            d["run_level"] = {
                "steps": run.steps,
                "gate": run.gate,
                "mre": run.mre,
                "status": {r: run.status(r) for r in run.mre},
                "describe": run.describe,
                "seconds": run.seconds,
                "losses": run.losses,
            }
        return d

    def write(self, out_dir: str | Path, *, all_ops: bool = False) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "align.json"
        path.write_text(json.dumps(_clean(self.to_dict(all_ops=all_ops)), indent=1) + "\n")
        if self.run is not None:
            plot_run(self.run, out / "align_loss.png")
        self.out_dir = out
        return path

    def print(self, console: Console | None = None, *, top: int = 12) -> None:
        console = console or make_console()
        t = Table(title="chip types under test (reference: host CPU, float64)")
        for col in ("chip", "policy", *[f"{k} level" for k in self.gates()]):
            t.add_column(col)
        names = dict(self.chips)
        if (self.layer is not None and "plan" in self.layer.chips) or (self.run is not None and "plan" in self.run.mre):
            names["plan"] = self.run.describe.get("plan", "the plan's stages") if self.run is not None else "per stage"
        for chip, desc in names.items():
            cells = []
            if self.op is not None:
                cells.append(_op_cell(self.op, chip) if chip in self.op.chips else "")
            if self.layer is not None:
                cells.append(_layer_cell(self.layer, chip) if chip in self.layer.chips else "")
            if self.run is not None:
                cells.append(
                    f"MRE {self.run.mre[chip]:.3%} {_st(self.run.status(chip))}" if chip in self.run.mre else ""
                )
            t.add_row(chip, desc, *cells)
        console.print(t)
        if self.op is not None:
            console.print(op_table(self.op, top=top))
        if self.layer is not None:
            console.print(layer_table(self.layer))
        for note in self.notes:
            console.print(f"note: {note}", highlight=False)
        verdict = "[green]every gate passes[/]" if self.passed() else "[bold red]some gate fails[/]"
        where = f"; report in {self.out_dir}" if self.out_dir else ""
        console.print(f"align: {verdict}{where}")


def _counts(statuses: list[str]) -> dict[str, int]:
    return {s: statuses.count(s) for s in ("pass", "warn", "fail")}


def _op_cell(op: OpLevel, chip: str) -> str:
    c = _counts([r.status[chip] for r in op.rows])
    first = op.first_fail.get(chip)
    text = f"{c['fail']} fail, {c['warn']} warn / {len(op.rows)}"
    if first is not None:
        text += f"\nfirst: {first.op.name} @ {first.op.module or '(model)'} ({first.op.direction})"
    return text


def _layer_cell(lay: LayerLevel, chip: str) -> str:
    fd = lay.first_divergent[chip]
    worst = max(r.rel_l2[chip] for r in lay.rows)
    text = f"max rel L2 {_num(worst)} {_st(layer_status(lay, chip))}"
    if fd["fwd"] or fd["bwd"]:
        text += f"\nfirst divergent: fwd {fd['fwd'] or '-'}, bwd {fd['bwd'] or '-'}"
    return text


def op_table(op: OpLevel, *, top: int = 12) -> Table:
    """The worst ops (by their worst chip's error ratio to the host), failing ones first."""
    order = {"fail": 0, "warn": 1, "pass": 2}

    def key(r):
        return (min(order[s] for s in r.status.values()), -max(r.ratio.values()))

    rows = sorted((r for r in op.rows if any(s != "pass" for s in r.status.values())), key=key)[:top]
    t = Table(title=f"op level: {len(op.rows)} ops of one step compared, worst {len(rows)} shown")
    for col in ("op", "source", "dtype"):
        t.add_column(col)
    for chip in op.chips:
        t.add_column(f"{chip} rel L2 (x host)")
    if len(op.chips) >= 2:
        t.add_column(f"{op.chips[1]}/{op.chips[0]}")
    for r in rows:
        cells = [f"{_num(r.chips[c].rel_l2)} ({r.ratio[c]:.3g}x) {_st(r.status[c])}" for c in op.chips]
        if r.pair is not None:
            cells.append(f"{r.pair[1]:.3g} {_st(r.pair[0])}")
        name = f"#{r.op.index} {r.op.name} @ {r.op.module or '(model)'} {r.op.direction}"
        t.add_row(name, r.op.source, r.dtype, *cells)
    return t


def layer_table(lay: LayerLevel) -> Table:
    t = Table(title=f"layer level: one step end to end, rel L2 vs reference (gate {lay.gate:g})")
    t.add_column("layer")
    t.add_column("dir")
    for chip in lay.chips:
        t.add_column(f"{chip} rel L2 (x host)")
    for r in lay.rows:
        t.add_row(
            r.layer, r.direction, *[f"{_num(r.rel_l2[c])} ({r.ratio[c]:.3g}x) {_st(r.status[c])}" for c in lay.chips]
        )
    return t


def plot_run(run: RunLevel, path: str | Path) -> Path:
    """Loss curves of every run and their relative error against the reference, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    steps = np.arange(run.steps)
    color = {name: f"C{i}" for i, name in enumerate(run.losses)}  # one colour per run in both panels
    for name, losses in run.losses.items():
        ax1.plot(steps, losses, label=name, lw=1.2 if name == "reference" else 0.9, color=color[name])
    ax1.set_ylabel("loss")
    ax1.legend()
    ax1.set_title(f"loss over {run.steps} steps; gate: MRE <= {run.gate:.1%} vs the float64 reference")
    for name in run.mre:
        rel = np.maximum(run.rel_error(name), 1e-12)
        ax2.semilogy(steps, rel, label=f"{name} (MRE {run.mre[name]:.3%})", lw=0.9, color=color[name])
    ax2.axhline(run.gate, color="k", ls="--", lw=0.8)
    ax2.set_xlabel("step")
    ax2.set_ylabel("|loss - ref| / ref")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _clean(x: Any) -> Any:
    """Plain JSON: non-finite floats as the strings "inf" / "nan", tuples as lists."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x
