"""Timeline: recording, Chrome trace round trip, bubble arithmetic, Gantt chart."""

from __future__ import annotations

import json
import threading

import pytest

from h2jax.runtime._timeline import (
    Timeline,
    TraceEvent,
    bubble_fraction,
    colour_key,
    load_trace,
    plot_gantt,
    stage_busy,
)

LABELS = ["stage 0 · sim_a (2x2)", "stage 1 · sim_b (4x1)"]


def _two_stage_step(tl: Timeline, step: int, base: float) -> None:
    """A hand-made 2-stage step, times in ms after ``base`` seconds.

    stage 0: F0 [0, 1], F1 [1, 2], send F0 [1, 1.5], B0 [5, 7], update [7, 8]
    stage 1: recv F0 [1, 1.5], F0 [1.5, 2.5], B0 [2.5, 4.5], send B0 [4.5, 5]
    """
    ms = 1e-3
    b = base
    tl.add("fwd", stage=0, step=step, microbatch=0, start=b + 0 * ms, end=b + 1 * ms, chip="sim_a")
    tl.add(
        "send",
        stage=0,
        step=step,
        microbatch=0,
        start=b + 1 * ms,
        end=b + 1.5 * ms,
        chip="sim_a",
        peer=1,
        bytes=4096,
        transport="local",
    )
    tl.add(
        "recv",
        stage=1,
        step=step,
        microbatch=0,
        start=b + 1 * ms,
        end=b + 1.5 * ms,
        chip="sim_b",
        peer=0,
        bytes=4096,
        transport="local",
    )
    tl.add("fwd", stage=0, step=step, microbatch=1, start=b + 1 * ms, end=b + 2 * ms, chip="sim_a")
    tl.add("fwd", stage=1, step=step, microbatch=0, start=b + 1.5 * ms, end=b + 2.5 * ms, chip="sim_b")
    tl.add("bwd", stage=1, step=step, microbatch=0, start=b + 2.5 * ms, end=b + 4.5 * ms, chip="sim_b")
    tl.add(
        "send",
        stage=1,
        step=step,
        microbatch=0,
        start=b + 4.5 * ms,
        end=b + 5 * ms,
        chip="sim_b",
        peer=0,
        bytes=4096,
        transport="local",
    )
    tl.add("bwd", stage=0, step=step, microbatch=0, start=b + 5 * ms, end=b + 7 * ms, chip="sim_a")
    tl.add("update", stage=0, step=step, microbatch=None, start=b + 7 * ms, end=b + 8 * ms, chip="sim_a")


@pytest.fixture
def timeline() -> Timeline:
    tl = Timeline(stage_labels=LABELS, t0=100.0)
    _two_stage_step(tl, step=0, base=100.0)
    _two_stage_step(tl, step=1, base=100.010)
    return tl


def test_add_converts_to_microseconds_relative_to_t0() -> None:
    tl = Timeline(stage_labels=LABELS, t0=10.0)
    ev = tl.add("fwd", stage=1, step=3, microbatch=2, start=10.5, end=10.75, chip="sim_b", bytes=8)
    assert ev == TraceEvent("fwd", 1, 3, 2, 500_000.0, 250_000.0, "sim_b", {"bytes": 8})
    assert ev.end_us == 750_000.0
    assert tl.events() == [ev]
    assert len(tl) == 1


def test_add_rejects_bad_input() -> None:
    tl = Timeline(stage_labels=LABELS)
    with pytest.raises(ValueError, match="unknown event kind"):
        tl.add("forward", stage=0, step=0, microbatch=0, start=0.0, end=1.0)
    with pytest.raises(ValueError, match="ends before it starts"):
        tl.add("fwd", stage=0, step=0, microbatch=0, start=2.0, end=1.0)


def test_default_t0_is_construction_time() -> None:
    import time

    before = time.perf_counter()
    tl = Timeline(stage_labels=LABELS)
    after = time.perf_counter()
    assert before <= tl.t0 <= after


def test_events_sorted_and_filtered_by_step(timeline: Timeline) -> None:
    all_events = timeline.events()
    assert len(all_events) == 18
    starts = [ev.start_us for ev in all_events]
    assert starts == sorted(starts)
    step1 = timeline.events(step=1)
    assert len(step1) == 9 and {ev.step for ev in step1} == {1}
    assert timeline.steps() == [0, 1]
    assert timeline.events(step=7) == []


def test_event_names() -> None:
    tl = Timeline(stage_labels=LABELS, t0=0.0)
    names = [
        tl.add("fwd", stage=0, step=0, microbatch=3, start=0, end=1).name,
        tl.add("bwd", stage=0, step=0, microbatch=3, start=0, end=1).name,
        tl.add("send", stage=0, step=0, microbatch=3, start=0, end=1, peer=1).name,
        tl.add("recv", stage=0, step=0, microbatch=3, start=0, end=1, peer=1).name,
        tl.add("send", stage=1, step=0, microbatch=3, start=0, end=1, peer=0).name,
        tl.add("recv", stage=1, step=0, microbatch=3, start=0, end=1, peer=0).name,
        tl.add("send", stage=1, step=0, microbatch=4, start=0, end=1, phase="fwd").name,
        tl.add("update", stage=0, step=0, microbatch=None, start=0, end=1).name,
        tl.add("other", stage=0, step=0, microbatch=None, start=0, end=1, name="clip").name,
    ]
    assert names == ["F3", "B3", "send F3", "recv B3", "send B3", "recv F3", "send F4", "update", "clip"]


def test_chrome_trace_structure(timeline: Timeline) -> None:
    trace = timeline.to_chrome_trace()
    assert set(trace) == {"traceEvents", "displayTimeUnit"}
    assert trace["displayTimeUnit"] == "ms"
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert len(complete) == 18
    for e in complete:
        assert {"name", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e)
        assert {"step", "stage", "microbatch", "kind"} <= set(e["args"])
        assert e["pid"] == e["args"]["stage"]
        assert e["tid"] == (1 if e["args"]["kind"] in ("send", "recv") else 0)
        assert e["dur"] >= 0

    by_name = {(e["pid"], e["name"], e["args"]["step"]): e for e in complete}
    f1 = by_name[(0, "F1", 0)]
    assert f1["ts"] == pytest.approx(1000.0) and f1["dur"] == pytest.approx(1000.0)
    assert f1["args"]["microbatch"] == 1 and f1["args"]["chip"] == "sim_a"
    send = by_name[(0, "send F0", 0)]
    assert send["args"]["bytes"] == 4096 and send["args"]["peer"] == 1
    assert send["args"]["transport"] == "local"
    assert by_name[(1, "recv F0", 0)]["tid"] == 1
    assert by_name[(1, "send B0", 0)]["args"]["kind"] == "send"
    assert by_name[(0, "update", 0)]["args"]["microbatch"] is None

    process_names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert process_names == {0: LABELS[0], 1: LABELS[1]}
    thread_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert thread_names == {(0, 0): "compute", (0, 1): "comm", (1, 0): "compute", (1, 1): "comm"}


def test_chrome_trace_round_trip(timeline: Timeline, tmp_path) -> None:
    path = timeline.save(tmp_path / "sub" / "trace.json")
    assert path.exists()
    json.loads(path.read_text())  # valid JSON
    assert load_trace(path) == timeline.events()


def test_chrome_trace_of_one_step(timeline: Timeline, tmp_path) -> None:
    timeline.save(tmp_path / "t.json", step=1)
    assert load_trace(tmp_path / "t.json") == timeline.events(step=1)


def test_load_trace_accepts_array_form_and_ignores_metadata(tmp_path) -> None:
    raw = [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "x"}},
        {
            "name": "F0",
            "ph": "X",
            "ts": 5.0,
            "dur": 2.0,
            "pid": 0,
            "tid": 0,
            "args": {"step": 2, "stage": 0, "microbatch": 0, "kind": "fwd"},
        },
    ]
    (tmp_path / "a.json").write_text(json.dumps(raw))
    assert load_trace(tmp_path / "a.json") == [TraceEvent("fwd", 0, 2, 0, 5.0, 2.0)]


def test_save_survives_non_json_extras(tmp_path) -> None:
    tl = Timeline(stage_labels=LABELS, t0=0.0)
    tl.add("send", stage=0, step=0, microbatch=0, start=0.0, end=1.0, shape=(4, 8), obj=object())
    (ev,) = load_trace(tl.save(tmp_path / "t.json"))
    assert ev.extra["shape"] == [4, 8]
    assert isinstance(ev.extra["obj"], str)


def _ev(kind: str, stage: int, start: float, dur: float, mb: int | None = 0) -> TraceEvent:
    return TraceEvent(kind=kind, stage=stage, step=0, microbatch=mb, start_us=start, dur_us=dur)


def test_stage_busy_and_bubble_fraction_exact() -> None:
    events = [
        _ev("fwd", 0, 0.0, 10.0),
        _ev("fwd", 1, 10.0, 10.0),
        _ev("bwd", 1, 20.0, 20.0),
        _ev("bwd", 0, 40.0, 20.0),
        # not compute: must not count towards busy time or the window
        _ev("send", 0, 10.0, 5.0),
        _ev("recv", 1, 38.0, 2.0),
        _ev("update", 0, 60.0, 40.0, mb=None),
        _ev("other", 1, -50.0, 10.0, mb=None),
    ]
    assert stage_busy(events, 2) == [30.0, 30.0]
    # window [0, 60]: 1 - 60 / (2 * 60) = 0.5
    assert bubble_fraction(events, 2) == 0.5
    # three stages, the third idle the whole window: 1 - 60 / (3 * 60)
    assert bubble_fraction(events, 3) == pytest.approx(2.0 / 3.0)
    assert stage_busy(events, 3) == [30.0, 30.0, 0.0]


def test_bubble_fraction_perfect_and_empty() -> None:
    assert bubble_fraction([_ev("fwd", 0, 0.0, 5.0), _ev("bwd", 1, 0.0, 5.0)], 2) == 0.0
    assert bubble_fraction([], 2) == 0.0
    assert bubble_fraction([_ev("update", 0, 0.0, 5.0)], 1) == 0.0


def test_bubble_fraction_of_timeline(timeline: Timeline) -> None:
    # step 0: compute window [0, 7] ms; busy: stage 0 = 1+1+2, stage 1 = 1+2 -> 7 of 14
    assert bubble_fraction(timeline.events(step=0), 2) == pytest.approx(0.5)
    assert stage_busy(timeline.events(step=0), 2) == pytest.approx([4000.0, 3000.0])


def test_stage_busy_rejects_out_of_range_stage() -> None:
    with pytest.raises(ValueError, match="num_stages=1"):
        stage_busy([_ev("fwd", 1, 0.0, 1.0)], 1)


def test_thread_safety() -> None:
    tl = Timeline(stage_labels=LABELS, t0=0.0)
    num_threads, per_thread = 16, 500
    barrier = threading.Barrier(num_threads)

    def worker(idx: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            tl.add("fwd", stage=idx % 2, step=idx, microbatch=i, start=float(i), end=i + 0.5)
            if i % 50 == 0:
                tl.events()  # concurrent reads must not break concurrent writes

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = tl.events()
    assert len(events) == num_threads * per_thread == len(tl)
    for idx in range(num_threads):
        assert sorted(ev.microbatch for ev in tl.events(step=idx)) == list(range(per_thread))


def test_plot_gantt_writes_png(timeline: Timeline, tmp_path) -> None:
    path = tmp_path / "plots" / "gantt.png"
    plot_gantt(timeline.events(step=0), path, stage_labels=LABELS, title="2 stages, 2 microbatches")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000


def test_plot_gantt_many_microbatches_and_empty(tmp_path) -> None:
    tl = Timeline(stage_labels=["a", "b", "c", "d"], t0=0.0)
    for s in range(4):
        for m in range(64):  # boxes too narrow for labels must still draw
            tl.add("fwd", stage=s, step=0, microbatch=m, start=(s + m) * 1e-4, end=(s + m + 0.9) * 1e-4)
    plot_gantt(tl.events(), tmp_path / "many.png", stage_labels=tl.stage_labels)
    plot_gantt([], tmp_path / "empty.png", stage_labels=["only"])
    assert (tmp_path / "many.png").stat().st_size > 10_000
    assert (tmp_path / "empty.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_gantt_draws_a_split_backwards_w_apart_from_b(tmp_path) -> None:
    tl = Timeline(stage_labels=["a"], t0=0.0)
    tl.add("fwd", stage=0, step=0, microbatch=0, start=0.0, end=1e-3)
    tl.add("bwd", stage=0, step=0, microbatch=0, start=1e-3, end=2e-3, part="B")
    tl.add("bwd", stage=0, step=0, microbatch=0, start=2e-3, end=3e-3, part="W")
    assert [colour_key(ev) for ev in tl.events()] == ["fwd", "bwd", "wgt"]
    plot_gantt(tl.events(), tmp_path / "zb.png", stage_labels=tl.stage_labels)
    assert (tmp_path / "zb.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_gantt_names_everything_it_draws(tmp_path, monkeypatch) -> None:
    """The hatching of a later layer chunk is in the legend; a span of seconds reads 2,840 ms,
    not 2.84e+03 ms."""
    from matplotlib.figure import Figure

    drawn = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig), save(fig, *a, **k))[1])
    tl = Timeline(stage_labels=["a"], t0=0.0)
    tl.add("fwd", stage=0, step=0, microbatch=0, start=0.0, end=1.0, chunk=0)
    tl.add("fwd", stage=0, step=0, microbatch=0, start=1.0, end=2.84, chunk=1)
    plot_gantt(tl.events(), tmp_path / "v.png", stage_labels=tl.stage_labels)
    (fig,) = drawn
    names = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert "a later layer chunk" in names, names
    titles = " ".join(ax.get_title(loc) for ax in fig.axes for loc in ("left", "center", "right"))
    assert "2,840 ms" in titles and "e+" not in titles, titles
