"""Per-endpoint figures from the locustfile's samples: requests/s, p50/p99 latency, shed and error counts."""

from __future__ import annotations

import statistics


def percentile(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(samples: dict, seconds: float) -> dict[str, dict]:
    """`samples` as the locustfile writes them: {endpoint: {ok_ms, ttft_ms, shed, errors, statuses}}."""
    rows = {}
    for name, sample in sorted(samples["endpoints"].items()):
        requests = sum(sample["statuses"].values())
        ok = len(sample["ok_ms"])
        rows[name] = {
            "requests": requests,
            "requests_per_s": round(requests / seconds, 2),
            "ok": ok,
            "shed": sample["shed"],
            "errors": sample["errors"],
            "error_rate": round(sample["errors"] / requests, 4) if requests else 0.0,
            "p50_ms": _round(percentile(sample["ok_ms"], 50)),
            "p99_ms": _round(percentile(sample["ok_ms"], 99)),
            "ttft_p50_ms": _round(percentile(sample["ttft_ms"], 50)),
            "statuses": dict(sample["statuses"]),
            "failures": samples["failures"].get(name, {}),
        }
    return rows


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def table(title: str, rows: dict[str, dict]) -> str:
    header = f"{'endpoint':<22} {'req':>6} {'req/s':>7} {'p50 ms':>8} {'p99 ms':>8} "
    header += f"{'ttft50':>7} {'shed':>6} {'errors':>6}"
    lines = [title, header, "-" * len(header)]
    for name, row in rows.items():
        cells = [row["p50_ms"], row["p99_ms"], row["ttft_p50_ms"]]
        p50, p99, ttft = ("-" if value is None else f"{value:.0f}" for value in cells)
        lines.append(
            f"{name:<22} {row['requests']:>6} {row['requests_per_s']:>7.2f} {p50:>8} {p99:>8} {ttft:>7} "
            f"{row['shed']:>6} {row['errors']:>6}"
        )
    return "\n".join(lines)
