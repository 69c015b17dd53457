"""How bench/compare_trl.py scores and draws its arms: the headline (minigrpo against TRL's best arm late in the
budget, and the share of TRL's time minigrpo needs to reach that arm's final accuracy) and the curves' plot."""
import statistics


def plot_curves(runs, arms, points, path):
    """Held-out pass@1 against training seconds, mean ± sd over seeds (shaded), one line per arm."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        xs = [0.0, *points]
        ys = [[r["pass@1_base"], *(r["pass@1"][f"{t:g}"] for t in points)] for r in mine]
        mean = [statistics.mean(col) for col in zip(*ys)]
        sd = [statistics.stdev(col) if len(col) > 1 else 0.0 for col in zip(*ys)]
        ax.plot(xs, mean, marker="o", label=f"{arm} ({len(mine)} seeds)")
        ax.fill_between(xs, [m - s for m, s in zip(mean, sd)], [m + s for m, s in zip(mean, sd)], alpha=0.2)
    ax.set_xlabel("training wall-clock (s)")
    ax.set_ylabel("held-out pass@1 (T=1)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def headline(runs, points) -> dict:
    """minigrpo against TRL's best arm (the highest mean pass@1 over the points in the last 40% of the budget):
    the margin there (mean ± sd of the seeds' margins), and the time minigrpo's mean curve needs to reach that arm's
    final mean pass@1, as a share of the budget (linear between points; the first point at or above it, too)."""
    late = [t for t in points if t >= 0.6 * points[-1] - 1e-9]
    mean_late = lambda r: statistics.mean(r["pass@1"][f"{t:g}"] for t in late)  # noqa: E731
    arms = {r["arm"] for r in runs if r["arm"] != "minigrpo"}
    if "minigrpo" not in {r["arm"] for r in runs} or not arms:
        return {}
    by = lambda arm: sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"])  # noqa: E731
    best = max(arms, key=lambda a: statistics.mean(map(mean_late, by(a))))
    margins = [mean_late(m) - mean_late(t) for m, t in zip(by("minigrpo"), by(best))]
    target = statistics.mean(r["pass@1"][f"{points[-1]:g}"] for r in by(best))
    xs = [0.0, *points]
    curve = [statistics.mean(r["pass@1_base"] for r in by("minigrpo")),
             *(statistics.mean(r["pass@1"][f"{t:g}"] for r in by("minigrpo")) for t in points)]
    reach = next((i for i, y in enumerate(curve) if y >= target), None)
    interp = None if reach is None else xs[reach] if reach == 0 else \
        xs[reach - 1] + (xs[reach] - xs[reach - 1]) * (target - curve[reach - 1]) / (curve[reach] - curve[reach - 1])
    return {"best_trl_arm": best, "late_points": late, "margin": statistics.mean(margins),
            "margin_sd": statistics.stdev(margins) if len(margins) > 1 else 0.0, "margins": margins,
            "target": target, "time_ratio_interpolated": None if interp is None else interp / points[-1],
            "time_ratio_first_point": None if reach is None else xs[reach] / points[-1]}
