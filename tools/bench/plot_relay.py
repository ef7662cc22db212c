#!/usr/bin/env python3
"""Plot a `handoff-bench relay --json` result.

Left: drain rate over time of the relay runs (events first marked published per 250 ms window,
as rows/s), with the same run's bounds and naive rate as horizontal lines. Right: commit-to-ack
latency percentiles per wake-up scenario and writer rate (log scale).

    python3 -m venv /tmp/plot && /tmp/plot/bin/pip install matplotlib
    /tmp/plot/bin/python tools/bench/plot_relay.py tools/bench/results/relay-2026-12-02.json docs/relay-drain.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

WINDOW_SECONDS = 0.25


def main(source, target):
    with open(source) as f:
        results = json.load(f)
    drain = {run["variant"]: run for run in results["drain"]}

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5))

    for variant, colour in (("relay_1", "tab:blue"), ("relay_2", "tab:orange")):
        run = drain.get(variant)
        if not run or not run["rate_windows"]:
            continue
        windows = run["rate_windows"]
        # Full windows only: the last one ends with the drain, and a rate over a sliver of a
        # window is noise.
        if run["seconds"] < len(windows) * WINDOW_SECONDS:
            windows = windows[:-1]
        times = [i * WINDOW_SECONDS for i in range(len(windows) + 1)]
        rates = [n / WINDOW_SECONDS for n in windows]
        rates.append(rates[-1])
        left.step(times, rates, where="post", color=colour,
                  label=f"{variant}: {run['rows_per_second']:,.0f} rows/s overall")
    for variant, style in (("sql_bound", "--"), ("jetstream_bound", ":"), ("naive", "-.")):
        run = drain.get(variant)
        if run:
            left.axhline(run["rows_per_second"], color="grey", linestyle=style,
                         label=f"{variant}: {run['rows_per_second']:,.0f} rows/s")
    left.set_xlabel("seconds since start")
    left.set_ylabel("events marked published per second (full 250 ms windows)")
    workload = results["workload"]
    left.set_title(f"Drain of {workload['events']:,} events over "
                   f"{workload['aggregates']:,} aggregates")
    left.set_ylim(bottom=0)
    left.grid(alpha=0.3)
    left.legend(fontsize=8, loc="best")

    latency = results.get("latency", [])
    if latency:
        labels = [f"{r['scenario']}\n{r['target_rate']}/s" for r in latency]
        xs = range(len(latency))
        width = 0.27
        for offset, key, colour in ((-width, "p50_ms", "tab:green"),
                                    (0, "p99_ms", "tab:red"),
                                    (width, "max_ms", "tab:purple")):
            values = [max(r[key], 0.01) for r in latency]
            right.bar([x + offset for x in xs], values, width, color=colour,
                      label=key.replace("_ms", ""))
        right.axhline(20, color="black", linestyle="--", linewidth=1,
                      label="goal: p99 <= 20 ms (NOTIFY, 1000/s)")
        right.set_yscale("log")
        right.set_xticks(list(xs))
        right.set_xticklabels(labels, fontsize=8)
        right.set_ylabel("commit to ack (ms, log scale)")
        right.set_title("Commit-to-ack latency, one relay, live writer")
        right.grid(axis="y", alpha=0.3, which="both")
        right.legend(fontsize=8, loc="upper left")
    else:
        right.set_axis_off()

    fig.tight_layout()
    fig.savefig(target, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: plot_relay.py RESULTS.json OUT.png")
    main(sys.argv[1], sys.argv[2])
