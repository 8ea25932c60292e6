"""The benchmark's chart (matplotlib, an optional extra) and the README's table."""

from __future__ import annotations

import sys

MATPLOTLIB_MISSING = (
    "scripts/benchmark.py draws its chart with matplotlib, which this Python ({python}) cannot import. "
    "matplotlib is needed only by the benchmark, so it is an optional extra: install it with "
    "`pip install 'tfdist[bench]'` (or `pip install 'matplotlib>=3.7'`) in this environment, or pass "
    "--no_chart to write benchmark.json alone. Nothing was measured yet."
)


def import_pyplot():
    """matplotlib's pyplot on the Agg backend, or SystemExit with one paragraph saying how to get it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(MATPLOTLIB_MISSING.format(python=sys.executable)) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw(report: dict, path: str) -> None:
    """Each row's score (A over B, or the bound over A's step) against its target, and the spe sweep."""
    plt = import_pyplot()
    rows = [r for r in report["rows"] if r["spe"] is None]
    sweep = sorted((r for r in report["rows"] if r["spe"] is not None), key=lambda r: r["spe"])
    panels = [p for p, present in (("bars", rows), ("sweep", sweep)) if present]
    fig, axes = plt.subplots(1, len(panels) or 1, figsize=(7.5 * max(1, len(panels)), 1.2 + 0.42 * max(8, len(rows))),
                             squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "bars":
            ys = list(range(len(rows)))
            colors = ["tab:gray" if r["target_met"] is None else "tab:green" if r["target_met"] else "tab:red"
                      for r in rows]
            ax.barh(ys, [r["scored"] for r in rows], color=colors, height=0.6)
            for y, r in zip(ys, rows):
                if r["target"] is not None:
                    ax.plot([r["target"]] * 2, [y - 0.4, y + 0.4], color="black", linewidth=2)
                ax.text(r["scored"], y, f" {r['scored']:.2f}", va="center", fontsize=7)
            ax.axvline(1.0, color="black", linewidth=0.5, linestyle=":")
            ax.set_yticks(ys)
            ax.set_yticklabels([r["row"] for r in rows], fontsize=8)
            ax.invert_yaxis()
            ax.set_xscale("log")
            ax.set_xlabel("A / B (ratio of medians; comm_mwms: bound / measured step), log scale; "
                          "black tick: target; green met, red not met", fontsize=7)
            ax.set_title("score per row")
        else:
            x = [r["spe"] for r in sweep]
            for side, name, color in (("a", "tfdist-train", "tab:blue"), ("b", "Keras model.fit", "tab:orange")):
                med = [r[side]["median"] for r in sweep]
                err = [[r[side]["median"] - r[side]["min"] for r in sweep],
                       [r[side]["max"] - r[side]["median"] for r in sweep]]
                ax.errorbar(x, med, yerr=err, marker="o", capsize=3, label=name, color=color)
            ax.set_xscale("log")
            ax.set_xticks(x)
            ax.set_xticklabels([str(v) for v in x])
            ax.set_xlabel("steps_per_execution")
            ax.set_ylabel("training examples/s (median, min-max)")
            ax.set_title("examples/s against steps_per_execution")
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
    m = report["machine"]
    s = report["settings"]
    fig.suptitle(f"{m['cpu_model']}, {m['cpu_cores']} cores, {m['gpus']} GPU(s); TF {m['tensorflow']}, "
                 f"Keras {m['keras']}; {s['precision']}, {s['epochs']} epochs, "
                 f"{s['repeats']} alternating runs a side; {m['date'][:10]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_table(report: dict) -> str:
    """The README's table: one line per row, its score and both sides' median (min-max), ms a step."""
    def side(s: dict, ms: float) -> str:
        return f"{s['label']}: {s['median'] / 1000:.2f}k ({s['min'] / 1000:.2f}-{s['max'] / 1000:.2f}k), {ms:.0f} ms"

    lines = ["| row | score | A examples/s, median (min-max), ms a step | B examples/s, median (min-max), ms a step "
             "| target |", "| --- | --- | --- | --- | --- |"]
    for r in report["rows"]:
        target = "" if r["target"] is None else f">= {r['target']:.2f}: {'met' if r['target_met'] else '**not met**'}"
        score = f"{r['scored']:.2f}x"
        if r["score"] == "bound":
            e = r["extra"]
            score = (f"{r['scored']:.2f} of bound (bound {e['bound_ms']:.0f} ms = forward {e['t_forward_ms']:.0f} + "
                     f"max(backward {e['t_backward_ms']:.0f}, comm {e['t_comm_ms']:.0f}))")
        lines.append(f"| `{r['row']}` {r['title']} | {score} | {side(r['a'], r['a_step_ms'])} "
                     f"| {side(r['b'], r['b_step_ms'])} | {target} |")
    return "\n".join(lines)
