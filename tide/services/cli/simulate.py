"""`tide simulate SCENARIO.yaml`: static allocation, the HPA path and Tide on one simulated
cluster (tide/services/sim, docs/simulate.md)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Annotated, Any

import typer

from tide.base import errors
from tide.services.cli import render
from tide.services.cli.app import Exit, echo, exit_code_of, fail
from tide.services.cli.output import NoHeadersOpt, OutputOpt, emit_document, print_table
from tide.services.cli.read import output_option


def clean(x: Any) -> Any:
    """JSON has no NaN or infinity: unknown numbers are null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [clean(v) for v in x]
    return x


def _overrides(items: list[str] | None) -> dict[str, Any]:
    import yaml  # loaded by the one command that reads YAML, not at every start-up

    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            fail(Exit.USAGE, f"--set: expected KEY=VALUE (e.g. pool.nodes=6), got {item!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


def _num(x: float, fmt: str) -> str:
    return "-" if not math.isfinite(x) else format(x, fmt)


HEADERS = (
    "POLICY",
    "DONE",
    "JCT MEAN H",
    "JCT P95 H",
    "GPU-H",
    "COST",
    "UTIL",
    "RESIZES",
    "FLAPS",
    "LOST STEPS",
    "REACTION S",
    "WORK/GPU-H",
)
#: ``-o wide`` adds these.
WIDE = ("MAKESPAN H", "REACTION UP S", "REACTION DOWN S", "TENANTS UNMET GPU-H", "EVENTS")


def outcome_rows(outcomes: list[Any], *, wide: bool) -> list[list[str]]:
    rows = []
    for o in outcomes:
        row = [
            o.policy,
            f"{o.completed}/{o.jobs}",
            _num(o.mean_jct_h, ".2f"),
            _num(o.p95_jct_h, ".2f"),
            _num(o.gpu_hours, ",.0f"),
            _num(o.cost, ",.0f"),
            _num(o.mean_util_pct, ".0f") + "%",
            str(o.resizes) + (f" (+{o.losses} lost)" if o.losses else ""),
            str(o.flaps),
            _num(o.lost_steps, ",.0f"),
            _num(o.reaction_s, ".1f"),
            _num(o.work_per_gpu_hour, ".2f"),
        ]
        if wide:
            row += [
                _num(o.makespan_h, ".1f"),
                _num(o.reaction_up_s, ".1f"),
                _num(o.reaction_down_s, ".1f"),
                _num(o.background_unmet_gpu_hours, ",.1f"),
                f"{o.events:,}",
            ]
        rows.append(row)
    return rows


def simulate_cmd(
    scenario_file: Annotated[Path, typer.Argument(metavar="SCENARIO.yaml", help="the scenario")],
    variant: Annotated[
        str | None,
        typer.Option(help="one of the scenario's variants, or 'all' for each in turn"),
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="override a key, e.g. --set pool.nodes=6 (repeat)"),
    ] = None,
    policy: Annotated[
        list[str] | None,
        typer.Option(help="only these policies: static, hpa, tide, tide-fcfs (repeat)"),
    ] = None,
    chart: Annotated[
        Path | None, typer.Option("--chart", help="write gpus.png, replicas.png, summary.png here")
    ] = None,
    jobs: Annotated[bool, typer.Option("--jobs", help="per-job results in the document")] = False,
    output: OutputOpt = "table",
    no_headers: NoHeadersOpt = False,
) -> None:
    """Simulate a GPU pool over days under static allocation, the HPA path and Tide."""
    from tide.services.sim import report, scenario

    out = output_option(output)
    if chart is not None and importlib.util.find_spec("matplotlib") is None:
        fail(Exit.USAGE, "--chart needs matplotlib: pip install 'tide[demo]'")
    overrides = _overrides(set_)
    try:
        base = scenario.load(scenario_file, "", overrides)
        names = list(base.variants) if variant == "all" else [variant or ""]
        if variant == "all":
            names = ["", *names]
        wanted = tuple(policy) if policy else None
        for p in wanted or ():
            if p not in scenario.POLICIES:
                fail(Exit.USAGE, f"--policy: unknown policy {p!r} ({', '.join(scenario.POLICIES)})")
        results = []
        for name in names:
            s = scenario.load(scenario_file, name, overrides) if name else base
            results.append(report.compare(s, wanted))
    except errors.TideError as exc:
        fail(exit_code_of(exc), str(exc))
    if chart is not None:
        from tide.services.sim.chart import draw

        for c in results:
            sub = (
                chart / c.scenario["variant"]
                if len(results) > 1 and c.scenario["variant"]
                else chart
            )
            try:
                for path in draw(c, sub):
                    if out.tabular:
                        echo(f"wrote {path}")
            except OSError as exc:
                fail(Exit.USAGE, f"--chart: cannot write {str(sub)!r}: {exc.strerror}")
    docs = [clean(c.doc(jobs=jobs)) for c in results]
    body = {"runs": docs} if len(docs) > 1 else docs[0]
    if emit_document(render.document("tide.simulate", **body), out):
        return
    for c in results:
        sc = c.scenario
        title = sc["name"] + (f" / {sc['variant']}" if sc["variant"] else "")
        days = sc["duration_s"] / 86400.0
        echo(f"{title}: {days:g} days, {sc['jobs']} jobs, {sc['pool_gpus']} GPUs")
        print_table(
            [*HEADERS, *(WIDE if out.wide else ())],
            outcome_rows(c.outcomes, wide=out.wide),
            no_headers=no_headers,
        )
        echo(
            f"simulated {days:g} days x {len(c.outcomes)} policies in {c.wall_s:.1f} s:"
            f" {c.sim_speed:,.0f} simulated seconds per wall second"
        )
