"""`--db`: the read commands against the SQL store (SQLite here) with no scaler running."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.cli.seed import JOB, OTHER, T0, Seeded, seed
from tide.services.cli.main import app

pytestmark = pytest.mark.component

runner = CliRunner()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Seeded]:
    url = f"sqlite:///{tmp_path_factory.mktemp('store') / 'tide.db'}"
    return url, seed(url)


def tide(*args: str) -> tuple[int, str, str]:
    r = runner.invoke(app, list(args))
    return r.exit_code, r.stdout, r.stderr


def test_history_from_the_store(store: tuple[str, Seeded]) -> None:
    url, ids = store
    code, out, err = tide("history", JOB, "--db", url, "--since", T0.isoformat(), "-o", "json")
    assert code == 0, err
    got = [(d["id"], d["state"], d["to_replicas"]) for d in json.loads(out)["decisions"]]
    assert got == [
        (ids.aborted, "ABORTED", 3),
        (ids.shrink, "COMPLETED", 2),
        (ids.grow, "COMPLETED", 4),
    ]


def test_history_at_a_given_time_and_state(store: tuple[str, Seeded]) -> None:
    url, ids = store
    at = T0.replace(second=0)
    code, out, _ = tide(
        "history",
        JOB,
        "--db",
        url,
        "--since",
        at.isoformat(),
        "--until",
        (at + timedelta(minutes=1)).isoformat(),
        "-o",
        "json",
    )
    assert code == 0
    assert [d["id"] for d in json.loads(out)["decisions"]] == [ids.grow]
    code, out, _ = tide(
        "history", "all", "--db", url, "--since", "3650d", "--state", "PREPARING", "-o", "json"
    )
    assert [d["id"] for d in json.loads(out)["decisions"]] == [ids.running]


def test_explain_from_the_store(store: tuple[str, Seeded]) -> None:
    url, ids = store
    code, out, err = tide("explain", str(ids.grow), "--db", url, "-o", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["decision"]["reason"] == "SUSTAINED_HIGH_UTILIZATION"
    assert doc["decision"]["pause_s"] == 2.5
    assert doc["inputs"]["window"]["bucket_means_pct"] == [91.0, None, 93.0, 92.0]
    assert doc["inputs"]["policy"]["sustain_s"] == 120
    assert doc["inputs"]["window"]["computed_at"] == "2026-11-30T14:05:12.000Z"
    assert doc["inputs"]["free_gpus"] == 6 and doc["inputs"]["raw_target_replicas"] == 4
    assert [e["state"] for e in doc["events"]] == ["PENDING", "PREPARING", "ACTUATING", "COMPLETED"]
    minutes = [u["minute"] for u in doc["utilization"]]
    assert minutes[0] == (T0.replace(second=0) - timedelta(minutes=10)).isoformat().replace(
        "+00:00", ".000Z"
    )
    assert len(minutes) == 21  # 10 before, the decision's minute, 10 after
    code, out, _ = tide("explain", str(ids.aborted), "--db", url)
    assert code == 0 and "barrier deadline" in out and "ABORTED" in out
    # The goodput guard's and the pool step's evidence.
    assert "samples/s by replicas 2: 200.0, 4: 300.0" in out
    assert "against 4 replicas: 0.50 of a replica's throughput" in out and "halved" in out
    assert "2 free GPUs by the marginal rule" in out and "ml/bert wants 1" in out
    doc = json.loads(tide("explain", str(ids.aborted), "--db", url, "-o", "json")[1])
    assert doc["inputs"]["goodput"]["throughput_by_replicas"] == {"2": 200.0, "4": 300.0}
    assert doc["inputs"]["pool"]["claims"][1]["granted_gpus"] == 1
    assert doc["inputs"]["goodput"]["verdict"] == "halved"
    grow = json.loads(tide("explain", str(ids.grow), "--db", url, "-o", "json")[1])
    assert grow["inputs"]["goodput"] is None and grow["inputs"]["pool"] is None


def test_jobs_from_the_store(store: tuple[str, Seeded]) -> None:
    url, ids = store
    code, out, _ = tide("jobs", "--db", url, "-o", "json")
    assert code == 0
    jobs = {j["job_id"]: j for j in json.loads(out)["jobs"]}
    assert jobs[JOB]["current_replicas"] == 2  # after the shrink; the abort kept it
    assert jobs[OTHER]["autoscaling_paused"] and jobs[OTHER]["active_decision_id"] == ids.running
    # What only a running scaler knows is said to be missing, not shown as a zero.
    doc = json.loads(out)
    assert (doc["source"], doc["policy_scope"]) == ("db", "overrides")
    assert set(doc["unavailable_fields"]) == {
        "step",
        "samples_per_s",
        "utilization_pct",
        "coverage",
        "last_evaluation",
        "failure",
    }
    assert "sustain_s" not in jobs[JOB]["policy"]  # a default, not stored
    code, out, err = tide("jobs", "--db", url)
    assert code == 0
    row = next(line for line in out.splitlines() if line.strip().startswith(JOB))
    assert row.count("n/a") == 4
    # The note goes to stderr: stdout holds the table's rows only.
    assert "known only to a running scaler" in err and "stored overrides" in err


def test_chart_from_the_store(store: tuple[str, Seeded], tmp_path: Path) -> None:
    url, _ = store
    out = tmp_path / "c.png"
    code, text, err = tide(
        "chart",
        JOB,
        "--db",
        url,
        "--since",
        T0.isoformat(),
        "--until",
        (T0 + timedelta(hours=4)).isoformat(),
        "--out",
        str(out),
    )
    assert code == 0, err
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert "3 decisions" in text


def test_not_found_in_the_store(store: tuple[str, Seeded]) -> None:
    url, _ = store
    assert tide("explain", "999", "--db", url)[0] == 1
    assert tide("history", "ml/none", "--db", url)[0] == 1
    assert tide("chart", "ml/none", "--db", url, "--out", "/tmp/none.png")[0] == 1


def test_store_without_schema_or_unreachable(tmp_path: Path) -> None:
    code, _, err = tide("jobs", "--db", f"sqlite:///{tmp_path / 'empty.db'}")
    assert code == 1 and "tide db upgrade" in err
    code, _, err = tide("jobs", "--db", "postgresql+psycopg://postgres@127.0.0.1:1/none")
    assert code == 3 and "unreachable" in err
    code, _, err = tide("jobs", "--db", "mysql://x")
    assert code == 2 and err.startswith("tide: ")


def test_db_in_a_missing_directory_says_so(tmp_path: Path) -> None:
    # Issue 30: it said "has no Tide schema" (and created the directory to say it).
    missing = tmp_path / "nowhere" / "tide.db"
    code, out, err = tide("history", "all", "--db", f"sqlite:///{missing}")
    assert code != 0
    assert f"directory {missing.parent} does not exist" in out + err
    assert not missing.parent.exists()


@pytest.mark.parametrize(
    ("args", "asked"), [((), [10_000]), (("--chunk-size", "2"), [2, 2]), (("--limit", "1"), [1])]
)
def test_history_from_the_store_reads_large_pages(
    store: tuple[str, Seeded],
    monkeypatch: pytest.MonkeyPatch,
    args: tuple[str, ...],
    asked: list[int],
) -> None:
    """`--db` is not bound by the API's 1,000 a page: `--all` reads 10,000 decisions a
    transaction (100,000 are 10 reads; bench.history), unless told otherwise."""
    from tide.services.scaler.store import pages

    seen: list[int] = []
    rows = pages.history_table_rows

    def counted(*a: object, page_size: int, **kw: object) -> object:
        seen.append(page_size)
        return rows(*a, page_size=page_size, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr("tide.services.scaler.store.history_table_rows", counted)
    url, _ = store
    all_ = () if "--limit" in args else ("--all",)
    code, _, err = tide("history", JOB, "--db", url, "--since", "3650d", *all_, *args)
    assert code == 0, err
    assert seen == asked
