"""Hyperband bracket arithmetic (Li et al. 2017) and the pure packed-Hyperband state machine,
fed with fake results (no Ray, no training)."""
from __future__ import annotations

import pytest

from jabasray.planners.pack_opt import PackingPlan, SearchSpace, knn_packing
from jabasray.tuner import hyperband_brackets, hyperband_schedule
from jabasray.tuner.state import PackedHyperbandState


def test_r81_eta3_is_li_et_al_table():
    """s=4: (81,1),(27,3),(9,9),(3,27),(1,81); s=3: (34,3),(11,9),(3,27),(1,81);
    s=2: (15,9),(5,27),(1,81); s=1: (8,27),(2,81); s=0: (5,81)."""
    assert hyperband_brackets(R=81, eta=3) == [
        [(81, 1), (27, 3), (9, 9), (3, 27), (1, 81)],
        [(34, 3), (11, 9), (3, 27), (1, 81)],
        [(15, 9), (5, 27), (1, 81)],
        [(8, 27), (2, 81)],
        [(5, 81)],
    ]
    sched = hyperband_schedule(81, 3)
    assert [b.s for b in sched] == [4, 3, 2, 1, 0]
    assert [b.keep(i) for i in range(5) for b in sched[:1]] == [27, 9, 3, 1, 0]


def test_small_and_fractional_cases():
    assert hyperband_brackets(1, 3) == [[(1, 1)]]
    assert hyperband_brackets(9, 3) == [[(9, 1), (3, 3), (1, 9)], [(5, 3), (1, 9)], [(3, 9)]]
    # R not a power of eta: s_max = floor(log2 10) = 3, r = 10/8 = 1.25 (fractional units kept)
    assert hyperband_brackets(10, 2)[0] == [(8, 1.25), (4, 2.5), (2, 5), (1, 10)]
    # s_max is computed without floating-point logs: 3^5 = 243 exactly
    assert len(hyperband_brackets(243, 3)) == 6 and len(hyperband_brackets(242, 3)) == 5


def test_bad_arguments():
    with pytest.raises(ValueError, match="eta must be an integer >= 2, got 1"):
        hyperband_brackets(81, 1)
    with pytest.raises(ValueError, match="R must be an integer >= 1, got 0"):
        hyperband_brackets(0, 3)


SPACE = SearchSpace.from_values({"lr": [0.001, 0.01, 0.1, 1.0], "act": ["relu", "tanh"],
                                 "bs": [8, 16, 32]})


def _fake_metric(cfg, rung):
    """Deterministic 'accuracy' growing with resource; best config has lr=0.1, act=tanh, bs=16."""
    return (-abs(SPACE.dimensions[0].values.index(cfg["lr"]) - 2) - abs(cfg["bs"] - 16) / 8
            + (cfg["act"] == "tanh") * 0.5 + 0.01 * rung)


def _run(plan_fn, R=9, eta=3, seed=0):
    st = PackedHyperbandState(SPACE, hyperband_schedule(R, eta), plan_fn, lambda r: int(r * 2),
                              "acc", "max", seed=seed, task_extra={"stream_batch": 32})
    trained = []
    while not st.finished:
        batch = []
        while (t := st.next_task()) is not None:
            batch.append(t)
        assert batch, "state neither finished nor offering work"
        for t in batch:
            assert {m["start"] for m in t["members"]} | {m["end"] for m in t["members"]}
            trained.append((t["bracket"], t["rung"], sorted(m["id"] for m in t["members"])))
            st.complete(t, {str(m["id"]): {"acc": _fake_metric(m["config"], t["rung"]),
                                           "checkpoint": f"/ckpt/{m['id']}_{m['end']}"}
                            for m in t["members"]})
    return st, trained


def _singletons(configs):
    return PackingPlan("none", [[i] for i in range(len(configs))], [1.0] * len(configs), 1.0)


def test_state_runs_successive_halving_with_fake_results():
    st, trained = _run(_singletons)
    sched = hyperband_schedule(9, 3)
    assert len(st.records) == sum(b.num_configs for b in sched) == 9 + 5 + 3
    for b in sched:
        ids = [r.config_id for r in st.records if r.bracket == b.s]
        for i, rung in enumerate(b.rungs):
            reached = [c for c in ids if len(st.records[c].history) > i]
            assert len(reached) == rung.n
            if i:   # survivors are the top n_i of the previous rung by the fake metric
                prev = sorted((c for c in ids if len(st.records[c].history) >= i),
                              key=lambda c: (-st.records[c].history[i - 1]["acc"], c))
                assert sorted(reached) == sorted(prev[:rung.n])
                assert all(st.records[c].history[i]["resource"] == rung.r for c in reached)
    res = st.result()
    best = res.records[res.best_config_id]
    assert best.last["acc"] == max(r.last["acc"] for r in res.records if r.history)
    assert res.best_config == best.config
    # every member of a later rung restarts from its own checkpoint of the previous rung
    assert best.checkpoint == f"/ckpt/{best.config_id}_{int(best.last['resource'] * 2)}"


def test_packed_and_unpacked_states_select_the_same_configurations():
    def knn(configs):
        return knn_packing(configs, SPACE, lambda c: 1.0, 4.0, seed=1)
    a, ta = _run(_singletons, R=27)
    b, tb = _run(knn, R=27)
    def strip(rec):
        return [{k: v for k, v in h.items() if k not in ("pack", "pack_size")} for h in rec.history]
    assert [r.config for r in a.records] == [r.config for r in b.records]
    assert [strip(r) for r in a.records] == [strip(r) for r in b.records]
    assert a.result().best_config_id == b.result().best_config_id
    assert max(len(m) for _, _, m in tb) == 4 and max(len(m) for _, _, m in ta) == 1
    # each configuration is in exactly one pack per rung it reaches
    for st, trained in ((a, ta), (b, tb)):
        seen = [(s, i, c) for s, i, ms in trained for c in ms]
        assert len(seen) == len(set(seen)) == sum(len(r.history) for r in st.records)


def test_state_rejects_unknown_or_incomplete_reports():
    st = PackedHyperbandState(SPACE, hyperband_schedule(3, 3), _singletons, lambda r: int(r),
                              "acc", "max", seed=0)
    t = st.next_task()
    with pytest.raises(ValueError, match="must report members"):
        st.complete(t, {})
    with pytest.raises(ValueError, match="is not outstanding"):
        st.complete({**t, "name": "nope"}, {})
