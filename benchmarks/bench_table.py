"""train_bench.py's ratios and its closing table (kept apart from the launcher)."""

from __future__ import annotations

import math
import statistics


def with_ratios(results: dict, peer_modes) -> dict:
    """Each measured row with x eager, x compile and x best peer (the fastest peer row of the
    layout that ran; its name in 'best_peer')."""
    def tps(mode: str) -> float | None:
        return results.get(mode, {}).get("tokens_per_s_per_gpu")

    peers = {m: tps(m) for m in results if m in peer_modes and tps(m)}
    best = max(peers, key=peers.get) if peers else None
    base, comp = tps("eager"), tps("compile-warm") or tps("compile")
    out = {}
    for mode, r in results.items():
        if "failed" in r:
            out[mode] = r
            continue
        t = r["tokens_per_s_per_gpu"]
        out[mode] = dict(r, x_eager=t / base if base else math.nan, x_compile=t / comp if comp else math.nan,
                         x_best_peer=t / peers[best] if best else math.nan, best_peer=best)
    return out


def print_table(rows: list[tuple[str, dict]]) -> None:
    w = max([7, *(len(layout) + 1 for layout, _ in rows)])
    print(f"{'layout':<{w}}{'mode':<14}{'tok/s/GPU':>10}{'MFU989':>8}{'MFUmeas':>8}{'1st step s':>11}{'wall s':>8}"
          f"{'peak GiB':>9}{'x eager':>8}{'x compile':>10}{'x best peer':>12}  best peer")
    for layout, results in rows:
        for mode, r in results.items():
            if "failed" in r:
                print(f"{layout:<{w}}{mode:<14}  FAILED: {r['failed']}")
                continue
            print(f"{layout:<{w}}{mode:<14}{r['tokens_per_s_per_gpu']:>10,.0f}{r['mfu']:>8.3f}{r['mfu_measured']:>8.3f}"
                  f"{r['first_step_s']:>11.1f}{r['wall_s']:>8.1f}{r['peak_gib']:>9.1f}"
                  f"{r['x_eager']:>8.2f}{r['x_compile']:>10.2f}{r['x_best_peer']:>12.2f}  {r['best_peer'] or '-'}")


def print_compact(rows: list[tuple[str, dict]], pipelines: dict[str, str] | None = None) -> None:
    """One line per row: tok/s/GPU, the step, peak memory, the first step's time and x best peer;
    each pipeline layout headed by its schedule and split (train_bench's `pipelines`)."""
    for layout, results in rows:
        print(f"{layout}: {(pipelines or {}).get(layout, 'no pipeline')}")
        print(f"  {'mode':<12}{'tok/s/GPU':>10}{'step ms':>9}{'peak GiB':>9}{'1st step s':>11}{'x best peer':>12}"
              "  losses (steps 1-3)")
        for mode, r in results.items():
            if "failed" in r:
                print(f"  {mode:<12}  FAILED: {r['failed']}")
                continue
            step_ms = statistics.median(r["step_times"][2:] or r["step_times"]) * 1e3
            losses = ", ".join(f"{x:.4f}" for x in r["losses"][:3])
            print(f"  {mode:<12}{r['tokens_per_s_per_gpu']:>10,.0f}{step_ms:>9.1f}{r['peak_gib']:>9.1f}"
                  f"{r['first_step_s']:>11.1f}{r['x_best_peer']:>12.2f}  {losses}"
                  + ("  (best peer)" if mode == r.get("best_peer") else ""))
